"""Megatron-LM's interleaved-pipeline and pipeline-layout flags, and their step: one of them names the virtual
stages per rank.

    --num-virtual-stages-per-pipeline-rank v      v chunks of layers per pipeline rank
    --num-layers-per-virtual-pipeline-stage n     the same, as layers per chunk: v = num_layers / (pp x n)
    --pipeline-model-parallel-layout STR          every stage spelled out: v = its stages / pp
    --decoder-first/last-pipeline-num-layers N, --account-for-embedding/loss-in-pipeline-split

They resolve to ``ParallelConfig.num_virtual_stages_per_pipeline_rank`` and the layout fields
(``megatron.config.pipeline_layout``); ``megatron.config.pipeline_schedule`` and ``RunConfig`` then check the
layout they make with the rest of the run.
"""

from __future__ import annotations

from megatron.config.pipeline_layout import layout_stage_count

__all__ = ["add_interleaved_arguments", "resolve_virtual_stages"]


def add_interleaved_arguments(parser) -> None:
    g = parser.add_argument_group("interleaved pipeline")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="Interleaved 1F1B (Megatron-LM's flag): each pipeline rank holds this many non-contiguous "
                        "chunks of layers (rank r: chunks r, r + PP, ...), which cuts the pipeline bubble to "
                        "(PP - 1) / (v x micro-batches + PP - 1) for v times the point-to-point traffic. --num-layers "
                        "must divide into PP x v chunks and the micro-batches per step into groups of PP. "
                        "Default: 1 (plain 1F1B).")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="The same as transformer layers per chunk (Megatron-LM's older flag): "
                        "v = --num-layers / (--pipeline-model-parallel-size x this).")
    g = parser.add_argument_group("pipeline layout")
    g.add_argument("--pipeline-model-parallel-layout", type=str, default=None, metavar="LAYOUT",
                   help="Megatron-LM's explicit pipeline layout: every stage's layers, E the embedding, t a "
                        "transformer layer, m an MTP depth (--mtp-num-layers; on the loss's stage), L the loss "
                        "(final norm and output head), '|' between stages, X*N and (...)*N repeat, commas only for reading; e.g. "
                        "DeepSeek-V3's 'Et|(tt|)*30mL'. With interleaving it lists PP x v stages (rank 0's first "
                        "chunk, rank 1's, ..., then the second chunks) and gives v. E first, L last, --num-layers t's; "
                        "every pipeline rank holds some layer. Replaces --pp-partition-method.")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None, metavar="N",
                   help="Transformer layers on the first pipeline rank (Megatron-LM's uneven pipeline); the ranks "
                        "between the first and the last share the others evenly. With interleaving, N / v per chunk.")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None, metavar="N",
                   help="Transformer layers on the last pipeline rank (see --decoder-first-pipeline-num-layers).")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="Count the embedding as one transformer layer when splitting the layers evenly over the "
                        "(virtual) stages: the first stage holds one layer fewer (Megatron-LM's flag; Qwen3-235B: "
                        "94 layers + embedding + loss = 96 = 8 stages x 4 virtual x 3).")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="Count the loss (final norm and output head) as one transformer layer when splitting the "
                        "layers evenly: the last stage holds one layer fewer.")


def resolve_virtual_stages(args) -> None:
    """``args.num_virtual_stages_per_pipeline_rank`` from whichever flag was given (ValueError when they disagree)."""
    v, per_chunk = args.num_virtual_stages_per_pipeline_rank, args.num_layers_per_virtual_pipeline_stage
    pp, num_layers = args.pipeline_model_parallel_size, args.num_layers
    layout = args.pipeline_model_parallel_layout
    if layout is not None:
        given = [flag for flag, value in (("--num-virtual-stages-per-pipeline-rank", v),
                                          ("--num-layers-per-virtual-pipeline-stage", per_chunk)) if value is not None]
        if given:
            raise ValueError(f"--pipeline-model-parallel-layout gives the virtual stages itself (its stages / "
                             f"--pipeline-model-parallel-size); drop {' and '.join(given)} (as in Megatron-LM)")
        stages = layout_stage_count(layout)
        if stages % pp:
            raise ValueError(f"--pipeline-model-parallel-layout {layout!r} lists {stages} stages, not a multiple of "
                             f"--pipeline-model-parallel-size {pp}: it lists PP x virtual stages per rank")
        args.num_virtual_stages_per_pipeline_rank = stages // pp
        return
    if per_chunk is not None and (args.decoder_first_pipeline_num_layers is not None
                                  or args.decoder_last_pipeline_num_layers is not None):
        raise ValueError("with --decoder-first/last-pipeline-num-layers give the virtual stages as "
                         "--num-virtual-stages-per-pipeline-rank (as in Megatron-LM)")
    # Megatron-LM: the embedding and the loss counted as layers count in the layers per chunk too
    num_layers += int(args.account_for_embedding_in_pipeline_split) + int(args.account_for_loss_in_pipeline_split)
    if per_chunk is not None:
        if per_chunk < 1 or num_layers % (pp * per_chunk):
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per_chunk} does not divide --num-layers "
                             f"{num_layers} into --pipeline-model-parallel-size {pp} x whole chunks: use a divisor "
                             f"of {num_layers // pp if num_layers % pp == 0 else num_layers} / {pp}")
        from_layers = num_layers // (pp * per_chunk)
        if v is not None and v != from_layers:
            raise ValueError(f"--num-virtual-stages-per-pipeline-rank {v} and --num-layers-per-virtual-pipeline-stage "
                             f"{per_chunk} disagree ({num_layers} layers / (PP {pp} x {per_chunk}) = {from_layers} "
                             f"virtual stages): give one of them")
        v = from_layers
    args.num_virtual_stages_per_pipeline_rank = 1 if v is None else v
