"""The FP8 training flags (one argument group) and their step: Megatron-LM's ``--fp8-*`` names, defaults and
meanings (``--fp8-format`` turns FP8 on; the numerics: ``megatron.parallel.fp8_linear``, the rules:
``megatron.config.fp8``).
"""

from __future__ import annotations

from megatron.config.fp8 import FP8_AMAX_COMPUTE_ALGOS, FP8_FORMATS, FP8_RECIPES, FP8Config

__all__ = ["add_fp8_arguments", "resolve_fp8", "fp8_warnings"]


def add_fp8_arguments(parser) -> None:
    g = parser.add_argument_group("FP8 training (--fp8-format)")
    g.add_argument("--fp8-format", default=None, choices=FP8_FORMATS,
                   help="Run the transformer layers' linear GEMMs (forward, data and weight gradients) with FP8 "
                        "operands: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 output gradients). Norms, "
                        "softmax, the embedding and the output layer keep the run's precision; parameters and "
                        "optimizer state keep theirs. Default: off.")
    g.add_argument("--fp8-recipe", default="delayed", choices=FP8_RECIPES,
                   help="Scaling: tensorwise (per tensor, from its current amax), delayed (per tensor, from the amax "
                        "history of earlier iterations), blockwise (DeepSeek-V3's 1x128 activation and 128x128 "
                        "weight blocks), mxfp8 (1x32 blocks, e8m0 scales). Default delayed (Megatron-LM's).")
    g.add_argument("--fp8-margin", type=int, default=0,
                   help="Delayed scaling: scales divided by 2^margin, headroom above the amax. Default 0.")
    g.add_argument("--fp8-amax-history-len", type=int, default=1,
                   help="Delayed scaling: iterations of amax history kept per tensor. Default 1.")
    g.add_argument("--fp8-amax-compute-algo", default="most_recent", choices=FP8_AMAX_COMPUTE_ALGOS,
                   help="Delayed scaling: the amax a scale comes from, the newest of the history (most_recent, "
                        "the default) or its largest (max).")
    g.add_argument("--fp8-interval", type=int, default=1,
                   help="Megatron-LM: deprecated since Transformer Engine 1.8 and ignored there. No effect here.")
    g.add_argument("--no-fp8-wgrad", action="store_false", dest="fp8_wgrad",
                   help="Compute the weight gradients in the run's precision (the forward and data gradient stay "
                        "FP8).")
    g.add_argument("--first-last-layers-bf16", action="store_true",
                   help="Keep the first --num-layers-at-start-in-bf16 and the last --num-layers-at-end-in-bf16 "
                        "transformer layers out of FP8. Not with --fp8-recipe delayed (as in Megatron-LM).")
    g.add_argument("--num-layers-at-start-in-bf16", type=int, default=1,
                   help="With --first-last-layers-bf16: the layers at the start without FP8. Default 1.")
    g.add_argument("--num-layers-at-end-in-bf16", type=int, default=1,
                   help="With --first-last-layers-bf16: the layers at the end without FP8. Default 1.")


_DEFAULTS = {"fp8_recipe": "delayed", "fp8_margin": 0, "fp8_amax_history_len": 1,
             "fp8_amax_compute_algo": "most_recent", "fp8_wgrad": True, "first_last_layers_bf16": False,
             "num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 1}


def resolve_fp8(args) -> None:
    """``args.fp8``: an ``FP8Config`` with --fp8-format, else None (checked against the layers per stage)."""
    if args.fp8_format is None:
        args.fp8 = None
        return
    args.fp8 = FP8Config(fp8_format=args.fp8_format, **{dest: getattr(args, dest) for dest in _DEFAULTS}).validate(
        args.num_layers, args.pipeline_model_parallel_size)


def fp8_warnings(args) -> list[str]:
    """The startup warnings of FP8 flags given with no effect."""
    out = []
    if args.fp8_interval != 1:
        out.append("--fp8-interval has no effect (deprecated by Transformer Engine 1.8, which ignores it too)")
    if args.fp8_format is None:
        given = sorted(f"--{dest.replace('_', '-')}" for dest, default in _DEFAULTS.items()
                       if getattr(args, dest) != default)
        given = ["--no-fp8-wgrad" if flag == "--fp8-wgrad" else flag for flag in given]
        if given:
            out.append(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect without --fp8-format")
    return out
