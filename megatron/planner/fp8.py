"""FP8 GEMMs in the planner (``--fp8-format``: ``megatron.config.fp8``; the implementation
``megatron.parallel.fp8_linear`` and ``fp8_quantize``): which GEMMs run in FP8, the bytes they add, and the HBM
traffic of their quantizers.

What runs in FP8: the column- and row-parallel linear layers of the transformer layers outside
``FP8Config.bf16_layers`` (--first-last-layers-bf16): QKV, the attention output projection, the MLP (fc1, fc2),
and in an MoE layer the shared expert's and the routed experts'; each in its three GEMMs (forward, data gradient, and the weight
gradient unless --no-fp8-wgrad). What stays in the run's precision: the core attention (softmax(QK^T)V), the
embedding, the output layer (logits), the router,
norms and the elementwise work. The planner runs the FP8 GEMMs at the GPU's FP8 peak
(``GPUSpec.peak_fp8_tflops``) with the bf16 GEMMs' efficiency (``performance.GEMM_EFFICIENCY``, assumed, not
measured), the rest at the bf16 peak; MFU stays model FLOPs over the bf16 peak.

Memory (``fp8_stage_bytes``): the implementation keeps no FP8 copy of the weights (each GEMM quantizes the bf16
weight and drops it); the transient is counted as the stage's largest FP8 weight in one byte per element. Delayed
scaling keeps, per FP8 linear layer, ``amax_history`` [len, 3] and ``scale`` [3] (checkpointed) and
``pending_amax`` [3], all fp32. Activations: an FP8 layer keeps its input for backward in FP8
(``megatron.planner.memory.fp8_kept_savings``).

Quantizer traffic (``quantize_bytes``): ``fp8_quantize`` quantizes with eager torch ops over an fp32 copy of the
operand, each a pass through HBM, counted per element of the operand with w its bytes (2 in bf16):
  per tensor (tensorwise, delayed)   amax |x| (read, |x| written and read: 3w), x.float() (w + 4), x * scale (8),
                                     clamp (8), cast to FP8 (5): 4w + 25
  blocks (blockwise, mxfp8)          x.float() (w + 4), |x| (8), block amax (4), x / scale (8), clamp (8), cast (5):
                                     w + 37
A linear layer quantizes per micro-batch: forward X and W; data gradient dY and W^T; weight gradient dY^T and X^T
(not with --no-fp8-wgrad); a recomputed forward X and W again. The block recipes' GEMM is one row-wise
``torch._scaled_mm`` per K block (``fp8_quantize.scaled_mm``), each [M, N] partial product written in bf16, read,
cast to fp32 and added into an fp32 sum: 20 bytes per output element and K block, plus the sum's zeroing and
final cast (10) and the operands' K-slice copies (2 bytes per element of each): counted as HBM traffic too.
Not modelled: tensorwise's amax all-reduces over TP (scalars: latency only, about 2 per linear layer and
micro-batch), the kernel launches of the block recipes' per-K-block loop.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

from megatron.config.fp8 import BLOCKWISE_BLOCK, MXFP8_BLOCK, FP8Config

__all__ = ["FP8Shape", "fp8_shape_of", "layer_linears", "stage_fp8_layers", "fp8_forward_flops", "fp8_stage_bytes",
           "quantize_bytes", "scaling_state_bytes", "PER_TENSOR_RECIPES"]

PER_TENSOR_RECIPES = ("tensorwise", "delayed")
BLOCK_ACCUMULATE_BYTES = 20  # per output element and K block: bf16 partial written + read, fp32 cast, fp32 add
BLOCK_SUM_BYTES = 10         # per output element: the fp32 sum zeroed (4) and cast to the output dtype (4 + 2)


@dataclasses.dataclass(frozen=True)
class FP8Shape:
    """The planner's view of an ``FP8Config``: which transformer layers run FP8, the recipe, and what it keeps."""

    layer_pattern: tuple[bool, ...]  # layer i (0-based) runs its linear GEMMs in FP8
    recipe: str = "delayed"
    wgrad: bool = True               # False: --no-fp8-wgrad, the weight gradients at the bf16 rate
    amax_history_len: int = 1
    fp8_format: str = "e4m3"

    @property
    def per_tensor(self) -> bool:
        return self.recipe in PER_TENSOR_RECIPES

    @property
    def k_block(self) -> int:
        """The K block of the block recipes' GEMM loop (0: per tensor, one GEMM)."""
        return {"blockwise": BLOCKWISE_BLOCK, "mxfp8": MXFP8_BLOCK}.get(self.recipe, 0)


def fp8_shape_of(config: Optional[FP8Config], num_layers: int) -> Optional[FP8Shape]:
    """The FP8Shape of a model's ``ModelConfig.fp8`` (None: no FP8)."""
    if config is None:
        return None
    bf16 = config.bf16_layers(num_layers)
    return FP8Shape(tuple(i not in bf16 for i in range(num_layers)), config.fp8_recipe, config.fp8_wgrad,
                    config.fp8_amax_history_len, config.fp8_format)


def stage_fp8_layers(model, layers_per_stage: Sequence[int]) -> list[tuple[int, int]]:
    """(dense, MoE) layers running FP8 on each pipeline stage, the stages holding consecutive layers in order
    ((0, 0) everywhere without FP8)."""
    out, start = [], 0
    for n in layers_per_stage:
        fp8 = [i for i in range(start, start + n) if model.fp8 is not None and model.fp8.layer_pattern[i]]
        moe = sum(1 for i in fp8 if model.is_moe_layer(i))
        out.append((len(fp8) - moe, moe))
        start += n
    return out


def layer_linears(model, tp: int, moe_layer: bool = False) -> list[tuple[float, float]]:
    """(N, K) of each FP8 linear layer of one transformer layer on one TP rank, its weight [N, K]: QKV and fc1
    split by rows (column-parallel), the output projection and fc2 by columns (row-parallel); an MoE layer's MLP is
    its shared expert's (none without one)."""
    h, mla = model.hidden_size, model.mla
    out = [((model.q_hidden + 2 * model.kv_hidden) / tp, h), (h, model.q_hidden / tp)]
    if mla is not None:  # MLA: the up-projections by heads and the output projection (the replicated
        heads = model.num_attention_heads  # down-projections run in bf16: megatron.model.latent_attention)
        out = [(heads * mla.q_head_dim / tp, mla.q_lora_rank or h),
               (heads * (mla.qk_head_dim + mla.v_head_dim) / tp, mla.kv_lora_rank), (h, heads * mla.v_head_dim / tp)]
    width = model.moe.shared_expert_ffn if moe_layer else model.ffn
    if width:
        out += [((2 if model.swiglu else 1) * width / tp, h), (h, width / tp)]
    return out


def fp8_forward_flops(model, rows: float, n_dense: int, n_moe: int) -> float:
    """The FP8 GEMMs' FLOPs of one forward of ``n_dense`` dense and ``n_moe`` MoE FP8 layers, over ``rows`` tokens,
    for the whole layer (not divided by TP), the same sum as the performance model's dense term."""
    h, mm = model.hidden_size, (3 if model.swiglu else 2)
    attention = model.attention_gemm_width if model.mla is None else \
        model.mla.split_weights(h, model.num_attention_heads) / h  # MLA's down-projections: bf16
    out = n_dense * 2 * rows * h * (attention + mm * model.ffn)
    if n_moe:  # the shared expert and the k routed experts each token goes through (not the router)
        moe = model.moe
        out += n_moe * 2 * rows * h * (attention + mm * (moe.shared_expert_ffn + moe.topk * moe.expert_ffn))
    return out


def routed_expert_linears(model, tp: int) -> list[tuple[float, float]]:
    """(N, K) of one routed expert's two FP8 GEMMs on one TP rank (W1: [(2) f / tp, h], W2: [h, f / tp])."""
    h, f = model.hidden_size, model.moe.expert_ffn
    return [((2 if model.swiglu else 1) * f / tp, h), (h, f / tp)]


def _quantize_pass_bytes(shape: FP8Shape, elements: float, width: int) -> float:
    return elements * ((4 * width + 25) if shape.per_tensor else (width + 37))


def _block_gemm_bytes(shape: FP8Shape, m: float, n: float, k: float) -> float:
    if shape.per_tensor:
        return 0.0
    return m * n * (BLOCK_ACCUMULATE_BYTES * math.ceil(k / shape.k_block) + BLOCK_SUM_BYTES) + 2 * k * (m + n)


def _linear_bytes(shape: FP8Shape, rows: float, n: float, k: float, weights: float, recompute: bool,
                  width: int) -> float:
    """One FP8 linear layer's quantizer passes and block sums in a micro-batch: ``rows`` tokens through ``weights``
    weight matrices [n, k] (one; a layer's routed experts: its local experts, the tokens split among them)."""
    x, w, dy = rows * k, weights * n * k, rows * n
    operands = (x + w) * (2 if recompute else 1) + dy + w + ((dy + x) if shape.wgrad else 0)
    gemms = [(rows, n, k)] * (2 if recompute else 1) + [(rows, k, n)] + ([(n * weights, k, rows)] if shape.wgrad else [])
    return _quantize_pass_bytes(shape, operands, width) + sum(_block_gemm_bytes(shape, *g) for g in gemms)


def quantize_bytes(model, rows: float, tp: int, n_dense: int, n_moe: int, recompute: bool, width: int = 2,
                   ep: int = 1) -> float:
    """HBM bytes the FP8 path adds over bf16 GEMMs in one micro-batch of a stage (forward, backward, a recomputed
    forward): the quantizers' passes and, for the block recipes, the per-K-block accumulation (module docstring)."""
    shape = model.fp8
    if shape is None or not n_dense + n_moe:
        return 0.0
    total = 0.0
    for count, moe in ((n_dense, False), (n_moe, True)):
        if not count:
            continue
        for n, k in layer_linears(model, tp, moe):
            total += count * _linear_bytes(shape, rows, n, k, 1, recompute, width)
        if moe:  # the routed experts: each token's k choices, over this rank's num_experts / ep experts
            for n, k in routed_expert_linears(model, tp):
                total += count * _linear_bytes(shape, rows * model.moe.topk, n, k, model.moe.num_experts / ep,
                                               recompute, width)
    return total


def scaling_state_bytes(model, n_dense: int, n_moe: int, tp: int) -> float:
    """Delayed scaling's fp32 buffers of a stage: per FP8 linear layer amax_history [len, 3], scale [3] and
    pending_amax [3]; 0 for the other recipes."""
    shape = model.fp8
    if shape is None or shape.recipe != "delayed":
        return 0.0
    linears = n_dense * len(layer_linears(model, tp)) + (n_moe * len(layer_linears(model, tp, True)) if n_moe else 0)
    return linears * (3 * shape.amax_history_len + 3 + 3) * 4


def fp8_stage_bytes(model, tp: int, n_dense: int, n_moe: int) -> dict[str, float]:
    """A stage's FP8 memory terms: ``fp8_transient`` (its largest FP8 weight quantized, 1 byte per element: one GEMM's
    at a time) and ``fp8_scaling_state`` (delayed scaling's buffers)."""
    largest = 0.0
    if n_dense:
        largest = max(n * k for n, k in layer_linears(model, tp))
    if n_moe and layer_linears(model, tp, True):
        largest = max(largest, max(n * k for n, k in layer_linears(model, tp, True)))
    return {"fp8_transient": largest, "fp8_scaling_state": scaling_state_bytes(model, n_dense, n_moe, tp)}
