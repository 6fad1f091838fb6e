"""Muon (``--optimizer muon``): momentum orthogonalised by Newton-Schulz for the 2-D weight matrices, AdamW for the rest.

For a weight matrix W with gradient g (after clipping), per step, with lr and wd the group's:

    W <- W (1 - lr wd)                                  decoupled weight decay
    m <- momentum m + (1 - momentum) g                  (--muon-momentum)
    u = m,  or with --muon-nesterov  u = g + momentum (m - g)
    W <- W - lr s NS(u)                                 s: --muon-scale-mode x --muon-extra-scale-factor

NS(u) is the quintic Newton-Schulz iteration on X = u / ||u||_F (transposed so that X is wide):
X <- a X + (b A + c A A) X, A = X X^T, with the (a, b, c) of each step of --muon-coefficient-type
(``megatron.config.muon``), in bf16 (--muon-fp32-matmul-prec medium) or fp32 (high). It drives the singular values
of u towards 1: the update is about U V^T of u = U S V^T. The scale s for an m x n matrix: spectral sqrt(max(m, n)),
unit_rms_norm sqrt(m / n), shape_scaling sqrt(max(1, m / n)). Megatron-LM's rule picks the matrices: every 2-D
parameter except the word embeddings and the output layer (``is_muon_parameter``; our stacked experts are 3-D and
their biases are biases); the other parameters take AdamW (--adam-beta1/2, --adam-eps, --lr, --weight-decay).

Tensor parallelism (``--muon-tp-mode``): a column- or row-parallel matrix is orthogonalised whole (duplicated, and
distributed, which gives the same result: the shards all-gathered over the TP group along the split dim, NS on every
rank, each keeping its shard) or per shard (blockwise, scaled by the shard's shape). The fused QKV weight, rows
[groups, q + k + v, hn], is orthogonalised as three matrices, its query, key and value rows, unless
--muon-no-split-qkv (Megatron-LM's split).

Where the matrices are: without ZeRO the optimizer sees the parameters themselves (the momentum is a full tensor).
Under ZeRO-1 / 2 and BF16_Optimizer (``attach_partitioned``) each data-parallel rank sees one flat fp32 partition
of each parameter group, whose gradient is already averaged and clipped: the momentum, Nesterov blend and weight
decay are elementwise and run on the partition (the momentum is sharded as Adam's state is); the blended momentum
is then all-gathered over the group's data-parallel ranks, each rank orthogonalises the matrices that overlap its
partition (the work spreads over DP) and keeps its slice of the update. DeepSpeed's own Muon path
(``deepspeed.runtime.zero.muon``) is not used: it puts the orthogonalised update through the gradient clipping,
has no TP and always runs its iteration in half precision with one coefficient set.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist
from torch.optim.adam import adam

from megatron.config.muon import ns_coefficients
from megatron.parallel.state import collective_device, group_size
from megatron.parallel.utils import param_is_tensor_parallel

__all__ = ["Muon", "attach_partitioned", "is_muon_parameter", "muon_scale", "newton_schulz", "qkv_split_rows"]


def newton_schulz(x: torch.Tensor, coefficients, *, bf16: bool = False, eps: float = 1e-7) -> torch.Tensor:
    """The Newton-Schulz orthogonalisation of the 2-D fp32 ``x`` with one (a, b, c) per step; fp32 out."""
    transpose = x.size(0) > x.size(1)
    X = x.mT if transpose else x
    X = X / X.norm().clamp_min(eps)
    if bf16:
        X = X.to(torch.bfloat16)
    for a, b, c in coefficients:
        A = X @ X.mT
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a, alpha=1.0)
    X = X.to(torch.float32)
    return X.mT if transpose else X


def muon_scale(rows: int, cols: int, mode: str) -> float:
    """--muon-scale-mode's factor for an update of a ``rows`` x ``cols`` matrix."""
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, rows / cols) ** 0.5
    raise ValueError(f"--muon-scale-mode {mode!r}")


def is_muon_parameter(name: str, param: torch.Tensor) -> bool:
    """Megatron-LM's rule: Muon takes 2-D parameters that are neither the word embeddings nor the output layer
    (``is_embedding_or_output_parameter`` there; ``vocab_parallel`` here marks both vocabulary matrices)."""
    shape = getattr(param, "ds_shape", param.shape)
    if len(shape) != 2 or name.endswith("bias"):
        return False
    return not (getattr(param, "vocab_parallel", False) or "word_embeddings" in name or "output_layer" in name)


def qkv_split_rows(model_config) -> Optional[tuple[int, int, int]]:
    """Rows of one query group of the fused QKV weight: (its query heads, its key head, its value head) x hn."""
    heads, groups = model_config.num_attention_heads, model_config.num_kv_heads
    hn = model_config.head_dim
    return (heads // groups * hn, hn, hn)


@contextlib.contextmanager
def _matmul_precision(precision: str):
    """--muon-fp32-matmul-prec high: torch's "high" (TF32 on GPUs that have it) around the iteration."""
    if precision != "high":
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


class Muon(torch.optim.Optimizer):
    """Muon over the groups marked ``muon`` and AdamW over the others (see the module docstring). ``tp_group``: the
    tensor-parallel group TP-split matrices are gathered over; ``qkv_rows``: ``qkv_split_rows`` of the model (the
    QKV weights are the parameters named ``query_key_value.weight``, marked at construction)."""

    def __init__(self, groups: list[dict], config, *, tp_group=None, qkv_rows=None, qkv_params=()):
        defaults = dict(lr=config.lr, weight_decay=config.weight_decay, betas=config.betas, eps=config.adam_eps,
                        momentum=config.muon_momentum, nesterov=config.muon_nesterov, muon=False)
        super().__init__(groups, defaults)
        self.coefficients = ns_coefficients(config.muon_coefficient_type, config.muon_num_ns_steps)
        self.scale_mode = config.muon_scale_mode
        self.extra_scale = config.muon_extra_scale_factor
        self.bf16_ns = config.muon_fp32_matmul_prec == "medium"
        self.precision = config.muon_fp32_matmul_prec
        self.blockwise = config.muon_tp_mode == "blockwise"
        self.tp_group = tp_group
        self.qkv_rows = tuple(qkv_rows) if (qkv_rows and config.muon_split_qkv) else None
        self._qkv = {id(p) for p in qkv_params}
        # the model's parameters of each group, kept: under ZeRO the groups come to hold flat partitions
        self._model_params = [list(g["params"]) for g in self.param_groups]
        # once attached (ZeRO / BF16_Optimizer), by id of a group's flat partition: its data-parallel group and
        # [(model parameter, offset in the group's flat buffer)]. By id: DeepSpeed's ZeRO steps one group at a time,
        # with param_groups set to that group alone
        self._partitions: dict[int, tuple] = {}

    # --- the matrices' orthogonalised updates ---------------------------------------------------------------
    def orthogonalize(self, param: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The scaled Newton-Schulz update of one matrix (this rank's TP shard ``u`` of ``param``'s momentum)."""
        if self.qkv_rows is not None and id(param) in self._qkv:
            per_group = sum(self.qkv_rows)
            groups = u.size(0) // per_group
            parts = torch.split(u.view(groups, per_group, u.size(1)), list(self.qkv_rows), dim=1)
            outs = [self._whole(param, p.reshape(-1, u.size(1))).view(groups, -1, u.size(1)) for p in parts]
            return torch.cat(outs, dim=1).view_as(u)
        return self._whole(param, u)

    def _whole(self, param: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        tp = group_size(self.tp_group)
        dim = getattr(param, "partition_dim", None) if param_is_tensor_parallel(param) else None
        if dim is None or tp == 1 or self.blockwise:
            return self._ns(u)
        shards = [torch.empty_like(u) for _ in range(tp)]
        dist.all_gather(shards, u.contiguous(), group=self.tp_group)
        whole = self._ns(torch.cat(shards, dim=dim))
        return whole.chunk(tp, dim=dim)[dist.get_rank(group=self.tp_group)]

    def _ns(self, u: torch.Tensor) -> torch.Tensor:
        with _matmul_precision(self.precision):
            out = newton_schulz(u.to(torch.float32), self.coefficients, bf16=self.bf16_ns)
        return out * (muon_scale(u.size(0), u.size(1), self.scale_mode) * self.extra_scale)

    # --- the step -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if not group["muon"]:
                self._adam(group)
            elif id(group["params"][0]) in self._partitions:
                self._muon_partition(group)
            else:
                self._muon_whole(group)
        return loss

    def _momentum(self, group: dict, param: torch.Tensor) -> torch.Tensor:
        """Weight decay on ``param``, the momentum updated with its gradient; the direction to orthogonalise."""
        grad = param.grad
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param, dtype=torch.float32)
        m = state["momentum_buffer"]
        if group["weight_decay"]:
            param.mul_(1 - group["lr"] * group["weight_decay"])
        m.lerp_(grad.to(m.dtype), 1 - group["momentum"])
        return grad.to(m.dtype).lerp(m, group["momentum"]) if group["nesterov"] else m

    def _muon_whole(self, group: dict) -> None:
        for param in group["params"]:
            if param.grad is None:
                continue
            update = self.orthogonalize(param, self._momentum(group, param))
            param.add_(update.to(param.dtype), alpha=-group["lr"])

    def _muon_partition(self, group: dict) -> None:
        (flat,) = group["params"]
        dp_group, layout = self._partitions[id(flat)]
        if flat.grad is None:
            flat.grad = torch.zeros_like(flat)
        u = self._momentum(group, flat)
        world, rank, size = group_size(dp_group), dist.get_rank(group=dp_group), flat.numel()
        pieces = [torch.empty_like(u) for _ in range(world)]
        dist.all_gather(pieces, u.contiguous(), group=dp_group)
        full = torch.cat(pieces)
        update = torch.zeros_like(u)
        lo, hi = rank * size, (rank + 1) * size
        for param, offset in layout:  # the same order on every TP peer: they hold the same shapes
            end = offset + param.numel()
            if end <= lo or offset >= hi:
                continue
            ortho = self.orthogonalize(param, full[offset:end].view(param.shape)).reshape(-1)
            a, b = max(offset, lo), min(end, hi)
            update[a - lo:b - lo] = ortho[a - offset:b - offset]
        flat.add_(update.to(flat.dtype), alpha=-group["lr"])

    def _adam(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            params.append(param)
            grads.append(param.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if params:
            beta1, beta2 = group["betas"]
            adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=True,
                                  decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2,
                                  lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                                  maximize=False)


def attach_partitioned(client, ds_optimizer) -> None:
    """After ``deepspeed.initialize``: when DeepSpeed's ZeRO-1 / 2 optimizer or BF16_Optimizer holds ``client``
    (a ``Muon``), tell it where each of its Muon groups' matrices lie in the group's flat buffer, and the group's
    data-parallel process group. Each matrix's offset comes from DeepSpeed's own fragment mapping (``_hp_mapping``:
    this rank's piece of a parameter and where it sits in the partition), maximised over the group's ranks (a
    parameter need not have a piece on every rank). No-op for other optimizers."""
    if not isinstance(client, Muon) or getattr(ds_optimizer, "optimizer", None) is not client:
        return
    dp_groups = getattr(ds_optimizer, "real_dp_process_group", None)
    if dp_groups is None:
        raise ValueError(f"--optimizer muon does not know DeepSpeed's {type(ds_optimizer).__name__}: it has no "
                         "per-group data-parallel partitions to gather the matrices from")
    for index, group in enumerate(client.param_groups):
        params = client._model_params[index]
        if not group["muon"]:
            continue
        (flat,) = group["params"]
        dp_group = dp_groups[index]
        start = dist.get_rank(group=dp_group) * flat.numel()
        offsets = torch.full((len(params),), -1, dtype=torch.int64)
        for i, param in enumerate(params):
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is not None:
                offsets[i] = start + mapping.hp_fragment_address.start - mapping.lp_fragment_address.start
        offsets = offsets.to(collective_device())
        dist.all_reduce(offsets, op=dist.ReduceOp.MAX, group=dp_group)
        offsets = offsets.cpu()
        if (offsets < 0).any():
            raise RuntimeError("--optimizer muon: a Muon matrix has no piece on any data-parallel rank")
        client._partitions[id(flat)] = (dp_group, list(zip(params, (int(o) for o in offsets), strict=True)))

