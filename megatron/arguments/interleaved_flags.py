"""Megatron-LM's interleaved-pipeline flags and their step: either one names the virtual stages per rank.

    --num-virtual-stages-per-pipeline-rank v      v chunks of layers per pipeline rank
    --num-layers-per-virtual-pipeline-stage n     the same, as layers per chunk: v = num_layers / (pp x n)

Both resolve to ``ParallelConfig.num_virtual_stages_per_pipeline_rank``; ``megatron.config.pipeline_schedule``
then checks the layout it makes with the rest of the run.
"""

from __future__ import annotations

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


def resolve_virtual_stages(args) -> None:
    """``args.num_virtual_stages_per_pipeline_rank`` from whichever flag was given (ValueError when they disagree)."""
    v, per_chunk = args.num_virtual_stages_per_pipeline_rank, args.num_layers_per_virtual_pipeline_stage
    pp, num_layers = args.pipeline_model_parallel_size, args.num_layers
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
