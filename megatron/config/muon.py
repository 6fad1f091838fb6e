"""The Muon optimizer's settings (``--optimizer muon``, Megatron-LM's ``--muon-*`` flags) and their rules.

Pure data (no torch): the choices of each flag, the Newton-Schulz coefficient sets by name (the published numbers,
one (a, b, c) per step of the quintic iteration X <- a X + (b A + c A^2) X, A = X X^T), and ``check_muon``, which
refuses what Megatron-LM refuses or what does not run here, with the cause. The optimizer is
``megatron.engine.muon``.
"""

from __future__ import annotations

from megatron.config._checks import _one_of

__all__ = ["MUON_COEFFICIENTS", "MUON_SCALE_MODES", "MUON_TP_MODES", "MUON_FP32_MATMUL_PRECS",
           "MUON_SCALAR_OPTIMIZERS", "check_muon", "ns_coefficients"]

# Megatron-LM reads these names from emerging_optimizers (NSCoeffT); the numbers are their published sources'.
MUON_COEFFICIENTS: dict[str, tuple[tuple[float, float, float], ...]] = {
    # Keller Jordan's Muon: one set, repeated every step
    "simple": ((3.4445, -4.7750, 2.0315),),
    # modded-nanogpt's per-step quintic sets (5 steps; more steps repeat the cycle)
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),
    # Polar Express (arXiv:2505.16932): at least 8 steps; more repeat the last
    "polar_express": ((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)),
    # flash-newton-schulz's AOL sets (4 steps; more repeat the cycle)
    "aol": ((4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
            (2.7215, -3.0494, 1.3169)),
}
MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
# blockwise: each TP shard orthogonalised on its own; duplicated: the whole matrix gathered on every TP rank;
# distributed (Megatron-LM: the Gram matrix all-reduced over TP): the same whole-matrix result, computed here as
# duplicated
MUON_TP_MODES = ("blockwise", "duplicated", "distributed")
MUON_FP32_MATMUL_PRECS = ("low", "medium", "high")
MUON_SCALAR_OPTIMIZERS = ("adam", "lion")


def ns_coefficients(kind: str, steps: int) -> tuple[tuple[float, float, float], ...]:
    """The (a, b, c) of each of ``steps`` Newton-Schulz steps for coefficient type ``kind`` (the rules of
    emerging_optimizers, which Megatron-LM uses: simple repeats its one set, polar_express needs >= 8 steps and
    repeats its last, the others need a multiple of their cycle)."""
    _one_of("--muon-coefficient-type", kind, tuple(MUON_COEFFICIENTS))
    sets = MUON_COEFFICIENTS[kind]
    if steps < 1:
        raise ValueError(f"--muon-num-ns-steps must be at least 1, got {steps}")
    if kind == "simple":
        return sets * steps
    if kind == "polar_express":
        if steps < len(sets):
            raise ValueError(f"--muon-num-ns-steps {steps} is below {len(sets)}, the polar_express sets' count")
        return sets + sets[-1:] * (steps - len(sets))
    if steps % len(sets):
        raise ValueError(f"--muon-num-ns-steps {steps} is not a multiple of {len(sets)}, the number of "
                         f"--muon-coefficient-type {kind} sets; use {len(sets)} or a multiple")
    return sets * (steps // len(sets))


def check_muon(config) -> None:
    """``OptimizerConfig`` with --optimizer muon: each --muon-* value checked, the unsupported refused with why."""
    ns_coefficients(config.muon_coefficient_type, config.muon_num_ns_steps)
    _one_of("--muon-scale-mode", config.muon_scale_mode, MUON_SCALE_MODES)
    _one_of("--muon-tp-mode", config.muon_tp_mode, MUON_TP_MODES)
    _one_of("--muon-fp32-matmul-prec", config.muon_fp32_matmul_prec, MUON_FP32_MATMUL_PRECS)
    _one_of("--muon-scalar-optimizer", config.muon_scalar_optimizer, MUON_SCALAR_OPTIMIZERS)
    if not 0 <= config.muon_momentum < 1:
        raise ValueError(f"--muon-momentum must be in [0, 1), got {config.muon_momentum}")
    if config.muon_fp32_matmul_prec == "low":
        raise ValueError("--muon-fp32-matmul-prec low: Megatron-LM accepts it but hands it to "
                         "torch.set_float32_matmul_precision, which has no 'low' (its first Muon step fails); "
                         "use medium (the Newton-Schulz iteration in bf16) or high (fp32)")
    if config.muon_scalar_optimizer == "lion":
        raise ValueError("--muon-scalar-optimizer lion is not implemented here; use adam (the default)")
