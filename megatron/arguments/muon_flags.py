"""The Muon optimizer's flags (one argument group): Megatron-LM's ``--muon-*`` names, defaults and meanings, for
``--optimizer muon`` (``megatron.engine.muon``; the rules: ``megatron.config.muon``). ``--lr``, ``--weight-decay``,
``--adam-beta1/2`` and ``--adam-eps`` keep their meanings: the learning rate and weight decay of both parts, the
betas and eps of the Adam part (embeddings, output layer, biases and norms).
"""

from __future__ import annotations

from megatron.config.muon import (
    MUON_COEFFICIENTS,
    MUON_FP32_MATMUL_PRECS,
    MUON_SCALAR_OPTIMIZERS,
    MUON_SCALE_MODES,
    MUON_TP_MODES,
)

__all__ = ["add_muon_arguments", "muon_warnings"]


def add_muon_arguments(parser) -> None:
    g = parser.add_argument_group("Muon optimizer (--optimizer muon)")
    g.add_argument("--muon-momentum", type=float, default=0.9,
                   help="Muon's momentum: m <- momentum m + (1 - momentum) g (an EMA of the gradient). Default 0.9.")
    g.add_argument("--muon-nesterov", action="store_true",
                   help="Nesterov-style momentum: orthogonalise g + momentum (m - g) instead of m.")
    g.add_argument("--muon-no-split-qkv", action="store_false", default=True, dest="muon_split_qkv",
                   help="Orthogonalise the fused QKV weight as one matrix. Default: its query, key and value rows "
                        "(per query group) as three matrices, as Megatron-LM does.")
    g.add_argument("--muon-scale-mode", default="spectral", choices=MUON_SCALE_MODES,
                   help="Scale of the orthogonalised update of an m x n matrix: spectral sqrt(max(m, n)), "
                        "unit_rms_norm sqrt(m / n), shape_scaling sqrt(max(1, m / n)). Default spectral.")
    g.add_argument("--muon-extra-scale-factor", type=float, default=1.0,
                   help="A further factor on the Muon update (0.2 x spectral matches AdamW's update RMS). "
                        "Default 1.")
    g.add_argument("--muon-num-ns-steps", type=int, default=5, help="Newton-Schulz steps. Default 5.")
    g.add_argument("--muon-coefficient-type", default="quintic", choices=tuple(MUON_COEFFICIENTS),
                   help="Newton-Schulz coefficients: quintic (modded-nanogpt's 5 per-step sets, the default), "
                        "simple (Keller Jordan's (3.4445, -4.7750, 2.0315) every step), polar_express (>= 8 steps), "
                        "aol (4 per-step sets).")
    g.add_argument("--muon-fp32-matmul-prec", default="medium", choices=MUON_FP32_MATMUL_PRECS,
                   help="Precision of the Newton-Schulz matmuls: medium runs the iteration in bf16 (fp32 in and "
                        "out), high in fp32 (TF32 on GPUs that have it). low is refused (torch has no such "
                        "precision). Default medium.")
    g.add_argument("--muon-tp-mode", default="duplicated", choices=MUON_TP_MODES,
                   help="A tensor-parallel matrix: duplicated orthogonalises the whole matrix (gathered over the "
                        "TP group on each rank; the update does not depend on TP), blockwise each rank's shard on "
                        "its own (scaled by the shard's shape), distributed gives the whole-matrix result as "
                        "duplicated does (computed here by gathering). Default duplicated.")
    g.add_argument("--muon-use-syrk", action="store_true",
                   help="Megatron-LM: a Triton SYRK kernel for the Gram matrix. No effect here (a kernel choice; "
                        "torch's matmul computes the same product).")
    g.add_argument("--muon-scalar-optimizer", default="adam", choices=MUON_SCALAR_OPTIMIZERS,
                   help="Optimizer of the parameters Muon does not take (embeddings, output layer, biases, "
                        "norms): adam (AdamW with --adam-beta1/2, --adam-eps). lion is refused (not implemented "
                        "here).")


_DEFAULTS = {"muon_momentum": 0.9, "muon_nesterov": False, "muon_split_qkv": True, "muon_scale_mode": "spectral",
             "muon_extra_scale_factor": 1.0, "muon_num_ns_steps": 5, "muon_coefficient_type": "quintic",
             "muon_fp32_matmul_prec": "medium", "muon_tp_mode": "duplicated", "muon_use_syrk": False,
             "muon_scalar_optimizer": "adam"}


def muon_warnings(args) -> list[str]:
    """The startup warnings of Muon flags accepted with no effect here (or computed another way to the same result)."""
    if args.optimizer != "muon":
        given = sorted(f"--{dest.replace('_', '-')}" for dest, default in _DEFAULTS.items()
                       if getattr(args, dest) != default)
        return [f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect without --optimizer muon "
                f"(--optimizer {args.optimizer})"] if given else []
    out = []
    if args.muon_use_syrk:
        out.append("--muon-use-syrk has no effect here: it picks Megatron-LM's Triton SYRK kernel for the Gram matrix "
                   "X X^T on GPUs; torch's matmul computes the same product")
    if args.muon_tp_mode == "distributed":
        out.append("--muon-tp-mode distributed runs as duplicated here: each TP-split matrix is gathered and "
                   "orthogonalised whole on every TP rank, the same whole-matrix result Megatron-LM's distributed "
                   "mode computes with an all-reduced Gram matrix")
    return out
