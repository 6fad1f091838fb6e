"""The YaRN long-context rotary flags (one argument group) and their step, under Megatron-LM's names and meanings.

YaRN is selected as Megatron-LM selects it: ``--position-embedding-type yarn`` for the fused-QKV attention (Llama /
Qwen3 style); for ``--multi-latent-attention`` by ``--rope-type`` (Megatron-LM's default for MLA is yarn, so
DeepSeek-V3's recipe, ``--position-embedding-type rope --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim
1.0``, trains with it). Its numbers: ``--rotary-scaling-factor`` (default 1: plain rotary),
``--yarn-original-max-position-embeddings`` (4096), ``--yarn-beta-fast`` (32), ``--yarn-beta-slow`` (1),
``--mscale`` (1), ``--mscale-all-dim`` (0) and ``--[no-]yarn-correction-range-round-to-int`` (rounded). Megatron-LM's
MLA reads the original context length and the betas from its config's defaults (4096, 32, 1) whatever the
``--yarn-*`` flags say; here they count for both attentions. A YaRN number given where YaRN is off is refused
(it would silently change nothing), as is ``--rope-type yarn`` without MLA (Megatron-LM asserts the same).
"""

from __future__ import annotations

__all__ = ["add_yarn_arguments", "resolve_yarn"]

# dest -> (flag, the default when not given: Megatron-LM's)
_NUMBERS = {"rotary_scaling_factor": ("--rotary-scaling-factor", 1.0),
            "yarn_original_max_position_embeddings": ("--yarn-original-max-position-embeddings", 4096),
            "yarn_beta_fast": ("--yarn-beta-fast", 32.0), "yarn_beta_slow": ("--yarn-beta-slow", 1.0),
            "mscale": ("--mscale", 1.0), "mscale_all_dim": ("--mscale-all-dim", 0.0),
            "yarn_correction_range_round_to_int": ("--yarn-correction-range-round-to-int", True)}


def add_yarn_arguments(parser) -> None:
    g = parser.add_argument_group("YaRN long-context rotary scaling")
    g.add_argument("--rope-type", choices=("rope", "yarn"), default=None,
                   help="With --multi-latent-attention: plain rotary (rope) or YaRN (yarn, Megatron-LM's default for "
                        "MLA; at --rotary-scaling-factor 1 it is plain rotary). Without MLA only rope is accepted "
                        "(YaRN is --position-embedding-type yarn there).")
    g.add_argument("--rotary-scaling-factor", type=float, default=None, metavar="FACTOR",
                   help="YaRN: how many times the original context is extended (DeepSeek-V3: 40, Qwen3: 4). "
                        "Default 1 (plain rotary).")
    g.add_argument("--yarn-original-max-position-embeddings", type=int, default=None, metavar="N",
                   help="YaRN: the context length the model was trained on before the extension (DeepSeek-V3: "
                        "4096, Qwen3: 32768). Default 4096.")
    g.add_argument("--yarn-beta-fast", type=float, default=None,
                   help="YaRN: rotary pairs turning more than this many times over the original context keep their "
                        "frequency. Default 32.")
    g.add_argument("--yarn-beta-slow", type=float, default=None,
                   help="YaRN: rotary pairs turning fewer than this many times over the original context are "
                        "interpolated (frequency / factor); the pairs between are mixed linearly. Default 1.")
    g.add_argument("--yarn-correction-range-round-to-int", action="store_true", default=None,
                   help="YaRN: round the ends of the mixing range outwards to whole pairs (the default; "
                        "transformers' truncate).")
    g.add_argument("--no-yarn-correction-range-round-to-int", action="store_false",
                   dest="yarn_correction_range_round_to_int",
                   help="YaRN: keep the mixing range's ends fractional (transformers' truncate False).")
    g.add_argument("--mscale", type=float, default=None,
                   help="YaRN: cos and sin are multiplied by (0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim "
                        "ln(factor) + 1). Default 1.")
    g.add_argument("--mscale-all-dim", type=float, default=None,
                   help="YaRN: the denominator's coefficient above; with --multi-latent-attention the softmax scale "
                        "is also multiplied by (0.1 mscale_all_dim ln(factor) + 1)^2 (DeepSeek-V3: 1.0). Default 0.")


def resolve_yarn(args) -> None:
    """``args.yarn``: the ModelConfig's ``yarn_*`` fields (an empty dict without YaRN). ValueError for a YaRN number
    given where YaRN is off, and for --rope-type yarn without --multi-latent-attention."""
    mla = bool(getattr(args, "multi_latent_attention", False))
    if args.rope_type is not None and not mla and args.rope_type != "rope":
        raise ValueError(f"--rope-type {args.rope_type} selects YaRN for --multi-latent-attention only (Megatron-LM "
                         f"asserts the same); for this attention use --position-embedding-type yarn")
    if mla and args.position_embedding_yarn:
        raise ValueError("--position-embedding-type yarn with --multi-latent-attention: MLA selects YaRN by "
                         "--rope-type (yarn, its default); use --position-embedding-type rope")
    on = args.position_embedding_yarn or (mla and args.rope_type in (None, "yarn")
                                          and args.position_embedding_type == "rotary")
    given = {dest: getattr(args, dest) for dest in _NUMBERS if getattr(args, dest) is not None}
    if not on:
        args.yarn = {}
        if given:
            flags = ", ".join(_NUMBERS[dest][0] for dest in given)
            if mla and args.position_embedding_type == "rotary":
                where, select = "--multi-latent-attention with --rope-type rope", "--rope-type yarn"
            elif mla:
                where = f"--multi-latent-attention with --position-embedding-type {args.position_embedding_type}"
                select = "--position-embedding-type rope (MLA's rope type is yarn by default)"
            else:
                where = f"--position-embedding-type {args.position_embedding_type}"
                select = "--position-embedding-type yarn"
            raise ValueError(f"{flags}: YaRN's numbers, but {where} has no YaRN; select it with {select} or drop "
                             f"them")
        return
    value = {dest: given.get(dest, default) for dest, (_, default) in _NUMBERS.items()}
    factor = value.pop("rotary_scaling_factor")
    args.yarn = dict(yarn_rotary_scaling_factor=None if factor == 1.0 else factor,
                     yarn_mscale=value.pop("mscale"), yarn_mscale_all_dim=value.pop("mscale_all_dim"), **value)
