"""Tolerances for two computations of the same numbers, derived from the dtypes and the depth.

Two correct computations that differ only in the order they sum in (another kernel or CPU instruction set,
a batch of rows instead of one, a reduction split over ranks) round differently. Along the path to a
compared number lie ``depth`` operations in sequence (a transformer layer has about twelve: two norms, the
attention products and softmax, the MLP products and activation, two residual adds). Each one

- rounds its result to the activations' dtype: a relative error of at most u = eps / 2, and
- sums ``width`` terms in the accumulation dtype (fp32 inside CPU matmuls, for bf16 inputs too), which
  two orders can make differ by about sqrt(width) units u of that dtype.

The roundings of different operations are independent, so they add up like a random walk, not in the
same direction every time (the probabilistic error analysis of Higham and Mary, SIAM J. Sci. Comput.
2019): over the path, about

    scale * (sqrt(depth) * eps(dtype) + sqrt(depth * width) * eps(accumulate))

with scale the size of the numbers compared (the largest magnitude of the reference) and eps = 2u, the
distance from 1 to the next number (2**-23 fp32, 2**-7 bf16), so a factor of two of margin is built in.
The tests that use it give the differences measured on both CPU kinds (AVX-512 / AMX, and AVX2, where the
kernels and their summation orders differ) and the margin left.

Training runs (``run_tolerance``): a loss or gradient norm logged at iteration k of two runs that compute
differently (another layout, schedule or kernels, a resume across layouts) is the end of a longer chain.
Its own step is a forward and a backward: the gradient passes back through every forward operation (one
product each) and ends in a weight gradient, ``step_depth = 2 * transformer_depth + 1`` roundings in the
activations' dtype, each summing up to ``width`` terms; a weight gradient sums over every token of the
global batch, so ``width`` is at least the batch's tokens. The k - 1 steps before it reach it through the
weights: both runs keep fp32 weights (bf16 runs: DeepSpeed's fp32 master copy) and update them by the same
rule, so each earlier step adds the roundings of its sums in fp32 and one rounding of the weights to the
activations' dtype:

    sqrt(step_depth + k - 1) * eps(dtype) + sqrt(k * step_depth * width) * eps(fp32)

relative to the number compared. In bf16 this is about 6% (2 layers, k = 10): one differing fp32 master
bit can flip a bf16 rounding of a weight, after which two bf16 runs are two bf16 computations; that holds
for two bf16 schedules that only accumulate micro-batches in another fp32 order too. Exactness (``==``) is
kept for what provably repeats the same operations in the same order: a resume at the same layout, the
same process run twice.
"""

from __future__ import annotations

import math

import torch

__all__ = ["tolerance", "transformer_depth", "model_tolerance", "step_depth", "run_tolerance", "fp8_run_tolerance",
           "OPS_PER_LAYER"]

# The roundings one transformer layer puts on the residual path, in sequence: input norm, QKV, Q.K^T, softmax,
# probabilities x V, dense, residual add, second norm, h -> 4h, activation, 4h -> h, residual add.
OPS_PER_LAYER = 12
# Around the layers: the embedding (and BLOOM's norm of it), the final norm, the head's product.
OPS_AROUND_LAYERS = 3


def transformer_depth(num_layers: int) -> int:
    """How many roundings lie in sequence between a token and a logit of a ``num_layers`` model."""
    return num_layers * OPS_PER_LAYER + OPS_AROUND_LAYERS


def tolerance(dtype: torch.dtype, depth: int, width: int, scale: float = 1.0,
              accumulate: torch.dtype = torch.float32) -> float:
    """How far two summation orders can move a result (module docstring): ``depth`` operations in sequence,
    each summing ``width`` terms in ``accumulate`` and rounding to ``dtype``, on numbers of size ``scale``."""
    if depth < 1 or width < 1:
        raise ValueError(f"depth and width must be positive, got depth={depth}, width={width}")
    if torch.finfo(accumulate).eps > torch.finfo(dtype).eps:
        accumulate = dtype  # nothing sums in a narrower type than it stores
    return scale * (math.sqrt(depth) * torch.finfo(dtype).eps
                    + math.sqrt(depth * width) * torch.finfo(accumulate).eps)


def model_tolerance(config, dtype: torch.dtype, reference: torch.Tensor) -> float:
    """``tolerance`` for the logits (or anything as deep) of a model built from ``config`` (a ModelConfig),
    against ``reference``: its layers' depth, its widest product (the MLP's), the reference's size."""
    width = max(config.hidden_size, config.ffn_hidden_size or 4 * config.hidden_size)
    return tolerance(dtype, transformer_depth(config.num_layers), width, scale=reference.abs().max().item())


def step_depth(num_layers: int) -> int:
    """Roundings in sequence from the weights to a weight gradient: the forward's, one product back through
    each of them for the input gradients, and the weight gradient's own product."""
    return 2 * transformer_depth(num_layers) + 1


def run_tolerance(dtype: torch.dtype, num_layers: int, width: int, iteration: int) -> float:
    """Relative tolerance for a loss or gradient norm logged at ``iteration`` (from 1) by two training runs of
    the same ``num_layers`` model on the same data that compute differently (module docstring); ``width``: the
    longest sum, at least the tokens of a global batch (a weight gradient sums over all of them)."""
    if iteration < 1:
        raise ValueError(f"iteration counts from 1, got {iteration}")
    depth, fp32 = step_depth(num_layers), torch.float32
    return (math.sqrt(depth + iteration - 1) * max(torch.finfo(dtype).eps, torch.finfo(fp32).eps)
            + math.sqrt(iteration * depth * width) * torch.finfo(fp32).eps)


def fp8_run_tolerance(dtype: torch.dtype, fp8_dtype: torch.dtype, num_layers: int, width: int,
                      iteration: int) -> float:
    """``run_tolerance`` for two runs whose GEMMs take FP8 operands (``--fp8-format``) and that compute differently
    otherwise (another layout): an operand that differs between them by its ``dtype`` rounding (eps_a) crosses an
    FP8 rounding boundary with probability about eps_a / eps_8 and then differs by eps_8, so per element the
    difference has root mean square sqrt(eps_a * eps_8); that is the rounding unit of the chain (``fp8_dtype``:
    the coarser FP8 type in use, e5m2 for hybrid's gradients)."""
    eps = math.sqrt(max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps) * torch.finfo(fp8_dtype).eps)
    depth = step_depth(num_layers)
    return (math.sqrt(depth + iteration - 1) * eps
            + math.sqrt(iteration * depth * width) * torch.finfo(torch.float32).eps)

