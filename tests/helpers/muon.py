"""Muon's test pieces (tests/engine/test_muon.py, tests/training/test_muon.py): the plain-PyTorch reference written
from the Muon definition (``reference_orthogonalize``, ``reference_steps``, the published coefficient sets, the scale
modes) and its fp32 tolerance (``ns_tolerance``); ``tp_orthogonalize_then_train``, a run_distributed target that
first orthogonalises fixed matrices split over TP = 2 in each --muon-tp-mode (the whole matrices are known to the test,
which computes the references) and then trains each argv (``tests.helpers.training.train``)."""

import math

import torch
import torch.distributed as dist

from tests.helpers.training import train

# The published coefficient sets, written out here (not read from megatron.config.muon)
KELLER_JORDAN = [(3.4445, -4.7750, 2.0315)]  # github.com/KellerJordan/Muon, every step
MODDED_NANOGPT = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                  (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]  # per step (emerging_optimizers' quintic)
SCALES = {"spectral": lambda m, n: math.sqrt(max(m, n)), "unit_rms_norm": lambda m, n: math.sqrt(m / n),
          "shape_scaling": lambda m, n: math.sqrt(max(1.0, m / n))}
EPS32 = torch.finfo(torch.float32).eps


def reference_orthogonalize(u, coefficients):
    """Newton-Schulz from the definition: X = u / ||u||_F (wide: transposed if tall), per step
    X <- a X + b (X X^T) X + c (X X^T)^2 X, in float64 (the reference's rounding is negligible)."""
    x = u.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / torch.linalg.matrix_norm(x)
    for a, b, c in coefficients:
        gram = x @ x.T
        x = a * x + b * (gram @ x) + c * (gram @ (gram @ x))
    return x.T if tall else x


def reference_steps(weight, grads, *, lr, wd, beta, nesterov, coefficients, scale_mode, extra):
    """The weights after each Muon step from ``weight`` with gradients ``grads`` (float64)."""
    w, m, out = weight.double(), torch.zeros_like(weight, dtype=torch.float64), []
    for g in grads:
        g = g.double()
        w = w * (1 - lr * wd)
        m = beta * m + (1 - beta) * g
        u = g + beta * (m - g) if nesterov else m
        w = w - lr * SCALES[scale_mode](*w.shape) * extra * reference_orthogonalize(u, coefficients)
        out.append(w)
    return out


def ns_tolerance(coefficients, inner):
    """How far fp32 Newton-Schulz can be from the exact iteration: each step's matmuls round by about inner x eps
    (relative, inner = the summed dimension), and a step multiplies an earlier error by at most its slope at 0, a;
    so about inner x eps x the sum over steps of the product of the later steps' a (entries of X are at most 1)."""
    total, growth = 0.0, 1.0
    for a, _, _ in reversed(coefficients):
        total += growth
        growth *= a
    return 3 * inner * EPS32 * (total + growth)


QKV_ROWS, HIDDEN = (4, 2, 2), 6  # one query group: 2 query heads, a key and a value head, head size 2


def tp_matrices() -> dict:
    """The whole matrices (the same on every rank): name -> (matrix, TP split dim)."""
    generator = torch.Generator().manual_seed(3)
    return {"column": (torch.randn(16, HIDDEN, generator=generator), 0),
            "row": (torch.randn(HIDDEN, 16, generator=generator), 1),
            "qkv": (torch.randn(4 * sum(QKV_ROWS), HIDDEN, generator=generator), 0)}  # 4 query groups


def tp_orthogonalize(rank, world_size) -> dict:
    """TP groups {0, 1} and {2, 3}: each rank's orthogonalised shard of each matrix, per --muon-tp-mode."""
    from megatron.config import OptimizerConfig
    from megatron.engine.muon import Muon

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tp_group, tp_rank = groups[rank // 2], rank % 2
    out = {}
    for mode in ("duplicated", "blockwise", "distributed"):
        config = OptimizerConfig(optimizer="muon", muon_tp_mode=mode, muon_fp32_matmul_prec="high")
        for name, (matrix, dim) in tp_matrices().items():
            shard = matrix.chunk(2, dim=dim)[tp_rank].clone()
            param = torch.nn.Parameter(shard.clone())
            param.tensor_model_parallel, param.partition_dim = True, dim
            optimizer = Muon([{"params": [param], "muon": True}], config, tp_group=tp_group, qkv_rows=QKV_ROWS,
                             qkv_params=[param] if name == "qkv" else [])
            out[f"{mode} {name}"] = optimizer.orthogonalize(param, shard)
    for group in groups:
        dist.destroy_process_group(group)
    return out


def tp_orthogonalize_then_train(rank, world_size, runs):
    return tp_orthogonalize(rank, world_size), train(rank, world_size, runs)
