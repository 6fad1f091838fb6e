"""FP8 GEMMs in the tensor-parallel layers: the three products of a linear layer with FP8 operands.

A layer with FP8 carries an ``FP8Scaling`` (``layer.fp8``; None: the plain ``linear``). Its forward
Y = X W^T and its backward's dX = dY W and dW = dY^T X each run as ``fp8_quantize.scaled_mm`` on operands
quantized along that product's reduction dimension (h, o and the tokens t): per tensor (tensorwise, delayed),
or in blocks (blockwise, mxfp8), which are quantized again from the high-precision tensor for each orientation,
as Transformer Engine does (a transposed block-scaled tensor is not the same quantization). Output gradients
are e5m2 under the hybrid format. ``--no-fp8-wgrad`` computes dW in the run's precision.

Memory: the backward keeps the input only as dW's FP8 operand (X^T quantized along t, 1 byte per element and its
scales: ``_kept_input``), not the high-precision X; per tensor that is the forward's quantized X itself, in blocks
X^T is quantized in the forward. The products are the same as quantizing in backward, bit for bit.

Scaling across ranks. Tensorwise: the amax of a tensor split over the tensor-parallel group (the weight shards;
a row-parallel layer's input; a column-parallel layer's output gradient) is all-reduced (MAX) over that group,
so every rank quantizes with the scale one process would use; the sequence-parallel input is gathered before it
is quantized (its amax is the gathered tensor's). Delayed: each iteration's amaxes (the max over its
micro-batches) are reduced over the ranks that hold the same layers (the TP group, then the data / sequence
group) by ``update_fp8_scales`` after the optimizer step, and pushed into the history the next iteration's
scales come from; the history and scales are buffers (in checkpoints: a resume continues bit for bit).
Block recipes have one scale per block and nothing to reduce.

With a ZB-H1 weight-gradient store, dW is deferred to it (``weight_grad_store``) like the plain layers'.

Shape letters: t tokens (leading dims flattened), h input features, o output features.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from megatron.config.fp8 import BLOCKWISE_BLOCK, MXFP8_BLOCK, FP8Config
from megatron.parallel.fp8_quantize import (
    FP8_DTYPES,
    Quantized,
    amax,
    quantize_blocks,
    quantize_tensor,
    scaled_mm,
    tensor_scale,
)
from megatron.parallel.state import group_size

__all__ = ["FP8Scaling", "fp8_linear", "enable_fp8", "update_fp8_scales", "fp8_layers", "match_fp8_state",
           "is_fp8_state_key"]

INPUT, WEIGHT, GRAD = 0, 1, 2  # the three operands, the rows of the delayed-scaling state


class FP8Scaling(torch.nn.Module):
    """One layer's FP8 settings and, under delayed scaling, its scaling state.

    ``sharded``: for (input, weight, output gradient), whether this rank holds only a tensor-parallel part of it
    (tensorwise reduces those amaxes over ``tp_group``). Buffers (delayed only): ``amax_history``
    [history_len, 3] (newest first) and ``scale`` [3], the quantization scales in use; ``pending_amax`` [3],
    this iteration's amaxes so far (not saved: an iteration is never resumed half-way).
    """

    def __init__(self, config: FP8Config, tp_group=None, sharded: tuple[bool, bool, bool] = (False, False, False)):
        super().__init__()
        self.config, self.tp_group, self.sharded = config, tp_group, sharded
        self.dtypes = (FP8_DTYPES[config.forward_dtype], FP8_DTYPES[config.forward_dtype],
                       FP8_DTYPES[config.grad_dtype])
        if config.fp8_recipe == "delayed":
            self.register_buffer("amax_history", torch.zeros(config.fp8_amax_history_len, 3))
            self.register_buffer("scale", torch.ones(3))
            self.register_buffer("pending_amax", torch.zeros(3), persistent=False)

    def _apply(self, fn, recurse=True):
        # the scaling state stays fp32 when the model is cast (module.to(bf16), an engine's .bfloat16())
        super()._apply(fn, recurse)
        for name, buffer in self._buffers.items():
            if buffer is not None and buffer.dtype != torch.float32:
                self._buffers[name] = buffer.float()
        return self

    @property
    def per_tensor(self) -> bool:
        return self.config.fp8_recipe in ("tensorwise", "delayed")

    def tensor_scale(self, x: torch.Tensor, role: int) -> torch.Tensor:
        """The quantization scale of ``x`` in ``role`` (per-tensor recipes); records its amax (delayed)."""
        current = amax(x)
        if self.config.fp8_recipe == "delayed":
            self.pending_amax[role] = torch.maximum(self.pending_amax[role], current.to(self.pending_amax.device))
            return self.scale[role].clone()
        if self.sharded[role] and group_size(self.tp_group) > 1:
            dist.all_reduce(current, op=dist.ReduceOp.MAX, group=self.tp_group)
        return tensor_scale(current, self.dtypes[role])

    def quantize(self, x: torch.Tensor, role: int, scale: Optional[torch.Tensor]) -> Quantized:
        """x [rows, K] quantized along K for ``role``: with the given per-tensor scale, or in the recipe's blocks."""
        dtype = self.dtypes[role]
        if scale is not None:
            return quantize_tensor(x, scale, dtype)
        if self.config.fp8_recipe == "mxfp8":
            return quantize_blocks(x, (1, MXFP8_BLOCK), dtype, mx=True)
        block = (BLOCKWISE_BLOCK, BLOCKWISE_BLOCK) if role == WEIGHT else (1, BLOCKWISE_BLOCK)
        return quantize_blocks(x, block, dtype)

    def extra_repr(self) -> str:
        return (f"recipe={self.config.fp8_recipe}, format={self.config.fp8_format}, "
                f"sharded(input, weight, grad)={self.sharded}")


def _kept_input(fp8: FP8Scaling, x: torch.Tensor, q_x: Quantized):
    """What the backward keeps of a layer's input X [t, h] for its weight gradient: the operand the product
    dW = dY^T X uses, X^T [h, t] quantized along t (1 byte per element and its scales, as Transformer Engine keeps
    the FP8 input instead of the high-precision one); X itself with --no-fp8-wgrad. Per tensor the quantizer is
    elementwise, so that operand is the forward's own ``q_x`` transposed (kept as it is, transposed in backward:
    the same bytes); in blocks X^T is quantized again along t (a transposed block-scaled tensor is not the same
    quantization), here, so that X need not be kept."""
    if not fp8.config.fp8_wgrad:
        return x
    if q_x.per_tensor:
        return Quantized(q_x.data, q_x.scale_inv, q_x.block[::-1])
    return fp8.quantize(x.t(), INPUT, None)


def _weight_grad(fp8: FP8Scaling, x, grad_output: torch.Tensor, grad_scale) -> torch.Tensor:
    """dW [o, h] = dY^T [o, t] @ X [t, h], both quantized along t: ``x`` is X^T so quantized (``_kept_input``),
    or X in the run's precision (--no-fp8-wgrad)."""
    if not isinstance(x, Quantized):
        return grad_output.t().matmul(x.to(grad_output.dtype))
    return scaled_mm(fp8.quantize(grad_output.t(), GRAD, grad_scale), x, grad_output.dtype)


@torch.no_grad()
def _accumulate_weight_grad(weight, fp8, x, grad_output, grad_scale) -> None:
    grad = _weight_grad(fp8, x, grad_output, grad_scale).to(weight.dtype)
    if weight.grad is None:
        weight.grad = grad
    else:
        weight.grad.add_(grad)


class _FP8Linear(torch.autograd.Function):
    """Y = X W^T + b with FP8 operands in all three products."""

    @staticmethod
    def forward(ctx, x, weight, bias, fp8: FP8Scaling, store):
        x2 = x.reshape(-1, x.shape[-1])  # [t, h]
        x_scale = fp8.tensor_scale(x2, INPUT) if fp8.per_tensor else None
        w_scale = fp8.tensor_scale(weight, WEIGHT) if fp8.per_tensor else None
        q_x = fp8.quantize(x2, INPUT, x_scale)
        y = scaled_mm(q_x, fp8.quantize(weight, WEIGHT, w_scale), x.dtype)  # [t, o]
        if bias is not None:
            y = y + bias.to(y.dtype)
        kept = _kept_input(fp8, x2, q_x) if ctx.needs_input_grad[1] else None
        if isinstance(kept, Quantized):
            ctx.save_for_backward(kept.data, kept.scale_inv)
            ctx.kept_block = kept.block
        else:
            ctx.save_for_backward(kept)
        # the parameter itself, not a saved tensor (see weight_grad_store._LinearDeferredWeightGrad)
        ctx.weight, ctx.fp8, ctx.store, ctx.has_bias = weight, fp8, store, bias is not None
        ctx.scales, ctx.input_shape = w_scale, x.shape
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        weight, fp8 = ctx.weight, ctx.fp8
        saved = ctx.saved_tensors  # read once (a checkpoint unpacks each saved tensor once)
        if len(saved) == 2:  # X^T quantized along t (or X quantized along h: per tensor, transposed)
            data, scale_inv = saved
            x2 = Quantized(data.t().contiguous() if fp8.per_tensor else data, scale_inv, ctx.kept_block)
        else:
            (x2,) = saved
        w_scale = ctx.scales
        dy = grad_output.reshape(-1, grad_output.shape[-1])  # [t, o]
        grad_scale = fp8.tensor_scale(dy, GRAD) if fp8.per_tensor else None
        grad_input = grad_weight = None
        if ctx.needs_input_grad[0]:
            # dX [t, h] = dY [t, o] @ (W^T [h, o])^T, quantized along o
            grad_input = scaled_mm(fp8.quantize(dy, GRAD, grad_scale), fp8.quantize(weight.t(), WEIGHT, w_scale),
                                   grad_output.dtype).reshape(ctx.input_shape)
        grad_bias = dy.sum(0) if ctx.has_bias else None
        if ctx.needs_input_grad[1]:
            if ctx.store is None:
                grad_weight = _weight_grad(fp8, x2, dy, grad_scale).to(weight.dtype)
            else:
                ctx.store.defer(partial(_accumulate_weight_grad, weight, fp8, x2, dy, grad_scale))
        return grad_input, grad_weight, grad_bias, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], fp8: FP8Scaling,
               store=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its GEMMs in FP8 (the output in x's dtype); with a ZB-H1 ``store``,
    the weight gradient is deferred to it (outside grad mode nothing is)."""
    if not torch.is_grad_enabled():
        store = None
    return _FP8Linear.apply(x, weight, bias, fp8, store)


def fp8_layers(module: torch.nn.Module) -> list[FP8Scaling]:
    """Every FP8Scaling under ``module``, in module order (the same on every rank holding the same layers)."""
    return [m for m in module.modules() if isinstance(m, FP8Scaling)]


def enable_fp8(module: torch.nn.Module, config: FP8Config) -> int:
    """Give every layer under ``module`` that can run its GEMMs in FP8 (it carries ``fp8_operand_sharding``: the
    column- and row-parallel layers, the MoE experts) its ``FP8Scaling`` (the experts: one per matrix, a
    ModuleDict), over the layer's own tensor-parallel group; the number of layers."""
    count = 0
    for layer in list(module.modules()):
        sharding = getattr(layer, "fp8_operand_sharding", None)
        if sharding is None:
            continue
        if isinstance(sharding, dict):
            layer.fp8 = torch.nn.ModuleDict({name: FP8Scaling(config, layer.tp_group, operands)
                                             for name, operands in sharding.items()})
        else:
            layer.fp8 = FP8Scaling(config, layer.tp_group, sharding)
        count += 1
    return count


@torch.no_grad()
def update_fp8_scales(module: torch.nn.Module, groups: tuple = ()) -> None:
    """Delayed scaling, after an optimizer step: this iteration's amaxes reduced (MAX) over each of ``groups`` (the
    ranks holding the same layers: the TP group, then the data / sequence group), pushed into each layer's history,
    and the next iteration's scales computed from it. Collective over ``groups``; nothing for other recipes."""
    layers = [m for m in fp8_layers(module) if m.config.fp8_recipe == "delayed"]
    if not layers:
        return
    pending = torch.stack([m.pending_amax for m in layers])  # [n, 3]
    for group in groups:
        if group_size(group) > 1:
            dist.all_reduce(pending, op=dist.ReduceOp.MAX, group=group)
    for m, amaxes in zip(layers, pending):
        history = torch.roll(m.amax_history, 1, dims=0)
        history[0] = amaxes
        m.amax_history.copy_(history)
        chosen = history[0] if m.config.fp8_amax_compute_algo == "most_recent" else history.amax(0)
        scales = torch.stack([tensor_scale(chosen[role], m.dtypes[role], m.config.fp8_margin)
                              for role in (INPUT, WEIGHT, GRAD)])
        usable = torch.isfinite(chosen) & (chosen > 0)  # else the scale in use stays (Transformer Engine's rule)
        m.scale.copy_(torch.where(usable, scales, m.scale))
        m.pending_amax.zero_()


def is_fp8_state_key(name: str) -> bool:
    """Whether a state-dict key is FP8 scaling state (``...fp8.amax_history`` / ``...fp8.scale``), not a weight."""
    return ".fp8." in f".{name}"


def match_fp8_state(module: torch.nn.Module, state_dict: dict, prefix: str) -> None:
    """A load_state_dict pre-hook for a module that may hold FP8 scaling state (a transformer layer): the saved
    scaling state of layers that now run without FP8 (or another recipe) is dropped, and the layers that now
    run delayed scaling and have none saved start from a fresh history (as a run's first iteration does). So a
    checkpoint loads whether or not either run used FP8; the weights are checked as strictly as before."""
    own = {prefix + name: buffer for name, buffer in module.state_dict().items() if is_fp8_state_key(name)}
    for key in [k for k in state_dict if k.startswith(prefix) and is_fp8_state_key(k[len(prefix):])]:
        if key not in own:
            del state_dict[key]
    for key, buffer in own.items():
        state_dict.setdefault(key, buffer.clone())
