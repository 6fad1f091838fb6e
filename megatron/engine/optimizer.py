"""The client optimizer DeepSpeed wraps: AdamW (or SGD, or Muon: megatron.engine.muon) over two parameter groups.

No weight decay on biases and norm weights (Megatron's rule: every 1-D parameter), weight decay on
the rest. DeepSpeed gets this torch optimizer as its client optimizer, so it never JIT-builds its
CPU FusedAdam; in bf16 it is wrapped by DeepSpeed's ``BF16_Optimizer`` (fp32 master weights,
ZeRO-1 partitioned across DP), which computes the grad norm and clips by itself.

In fp32 without ZeRO, DeepSpeed's own clipping counts TP-replicated parameters only on the
rank of model-parallel index 0, which on a pipeline means stage 0: layer norms of later stages
would be missing from the norm. :class:`GradNormClippingOptimizer` replaces it with the norm
computed over our groups: every parameter once, across tensor- and pipeline-parallel ranks.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from megatron.config import OPTIMIZERS, OptimizerConfig
from megatron.engine.adam_state_dtypes import STATE_DTYPES, AdamWStateDtypes
from megatron.engine.deepspeed_compat import is_moe_parameter
from megatron.engine.muon import Muon, is_muon_parameter, qkv_split_rows
from megatron.model.moe import is_expert_parallel
from megatron.parallel.replicated import sync_tp_duplicated_parameters, tp_duplicated_parameters
from megatron.parallel.state import group_size
from megatron.parallel.utils import param_is_tensor_parallel


def param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decayed weight matrices, and undecayed biases / norm weights (all 1-D params). With expert
    parallelism, the experts' parameters (marked by ``megatron.engine.expert_parallel``) form two more, which
    DeepSpeed reduces and shards over their expert-data-parallel group: ``moe = True``, named by that group."""
    decay, no_decay, expert_decay, expert_no_decay = [], [], [], []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        # ZeRO-3 holds a partitioned parameter as an empty 1-D placeholder: its own shape is ds_shape
        ndim = len(getattr(param, "ds_shape", param.shape))
        no_decay_param = ndim == 1 or name.endswith("bias")  # the experts' biases are [El, n]: "experts.fc1_bias"
        if is_moe_parameter(param):
            (expert_no_decay if no_decay_param else expert_decay).append(param)
        else:
            (no_decay if no_decay_param else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    for params, decayed in ((expert_decay, weight_decay), (expert_no_decay, 0.0)):
        if params:
            groups.append({"params": params, "weight_decay": decayed, "name": params[0].group_name, "moe": True})
    return [g for g in groups if g["params"]]


def decoupled_lr_groups(groups: list[dict], config: OptimizerConfig) -> list[dict]:
    """With Megatron-LM's ``--decoupled-lr``: the word embedding's and the output layer's weights (marked
    ``is_embedding_or_output_parameter`` by megatron.model.embedding) moved from their group into one of their own
    with ``max_lr`` / ``min_lr``, which the scheduler (megatron.training.lr_schedule) follows. Else ``groups``."""
    if config.decoupled_lr is None:
        return groups
    out, decoupled = [], []
    for group in groups:
        own = [p for p in group["params"] if getattr(p, "is_embedding_or_output_parameter", False)]
        rest = [p for p in group["params"] if not getattr(p, "is_embedding_or_output_parameter", False)]
        if own:
            decoupled.append(dict(group, params=own, name=group["name"] + "_decoupled_lr", max_lr=config.decoupled_lr,
                                  min_lr=config.min_lr if config.decoupled_min_lr is None else config.decoupled_min_lr))
        if rest:
            out.append(dict(group, params=rest))
    return out + decoupled


def build_client_optimizer(module: torch.nn.Module, config: OptimizerConfig, *, tp_group=None,
                           model_config=None) -> torch.optim.Optimizer:
    """The torch optimizer ``config`` describes over ``module``'s parameter groups. Muon
    (``megatron.engine.muon``) takes the decayed group's matrices in a group of their own (``tp_group``: the
    group TP-split matrices are gathered over; ``model_config``: where the fused QKV rows split)."""
    groups = decoupled_lr_groups(param_groups(module, config.weight_decay), config)
    if config.optimizer == "muon":
        return _muon(module, groups, config, tp_group, model_config)
    if config.optimizer == "adam" and (config.exp_avg_dtype, config.exp_avg_sq_dtype) != ("fp32", "fp32"):
        # Megatron-LM's precision-aware optimizer: the moments stored in bf16 / fp16
        return AdamWStateDtypes(groups, lr=config.lr, betas=config.betas, eps=config.adam_eps,
                                weight_decay=config.weight_decay, exp_avg_dtype=STATE_DTYPES[config.exp_avg_dtype],
                                exp_avg_sq_dtype=STATE_DTYPES[config.exp_avg_sq_dtype])
    if config.optimizer == "adam":
        # Megatron's "adam" is AdamW (decoupled weight decay). foreach: fast on CPU and GPU alike.
        return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.adam_eps,
                                 weight_decay=config.weight_decay, foreach=True)
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum, weight_decay=config.weight_decay)
    raise ValueError(f"--optimizer {config.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")


def _muon(module, groups: list[dict], config: OptimizerConfig, tp_group, model_config) -> torch.optim.Optimizer:
    matrices = {id(p) for name, p in module.named_parameters() if p.requires_grad and is_muon_parameter(name, p)}
    qkv = [p for name, p in module.named_parameters() if name.endswith("query_key_value.weight")]
    out = []
    for group in groups:
        muon = [p for p in group["params"] if id(p) in matrices]
        rest = [p for p in group["params"] if id(p) not in matrices]
        if muon:
            out.append(dict(group, params=muon, name="muon", muon=True))
        if rest:
            out.append(dict(group, params=rest, muon=False))
    rows = qkv_split_rows(model_config) if model_config is not None else None
    return Muon(out, config, tp_group=tp_group, qkv_rows=rows, qkv_params=qkv)


def _counted_once(param: torch.Tensor, tp_rank: int) -> bool:
    """Whether this rank's copy of ``param`` enters the global norm (each parameter exactly once)."""
    if getattr(param, "ds_pipe_replicated", False):  # the tied embedding's second copy (last stage)
        return False
    return tp_rank == 0 or param_is_tensor_parallel(param)


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack([torch.linalg.vector_norm(g.detach(), dtype=torch.float32) for g in grads]).square().sum()


def global_grad_norm(params: Iterable[torch.Tensor], *, tp_rank: int, model_group, expert_group=None,
                     experts_span_tp: bool = False) -> float:
    """L2 norm of all gradients of the model replica (summed over its TP x PP ranks, and for the MoE experts,
    which each expert-parallel rank holds a share of, over ``expert_group`` too). ``experts_span_tp``: the experts
    are whole on every TP rank and ``expert_group`` spans TP ranks (--expert-tensor-parallel-size 1): each rank's
    experts count in full there, and the group's sum enters on TP rank 0 only."""
    def once(p):
        return experts_span_tp and is_expert_parallel(p) or _counted_once(p, tp_rank)

    counted = [p for p in params if p.grad is not None and once(p)]
    squares = _sum_of_squares([p.grad for p in counted if not is_expert_parallel(p)])
    expert_squares = _sum_of_squares([p.grad for p in counted if is_expert_parallel(p)])
    if expert_group is not None:
        dist.all_reduce(expert_squares, group=expert_group)
    if experts_span_tp and tp_rank != 0:  # TP rank 0's expert group has every expert of the stage already
        expert_squares = torch.zeros_like(expert_squares)
    squares = squares + expert_squares
    if model_group is not None:
        dist.all_reduce(squares, group=model_group)
    return math.sqrt(squares.item()) if math.isfinite(squares.item()) else float("inf")


class GradNormClippingOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer: computes the global grad norm, skips the step if it is not finite,
    clips to ``clip_grad`` (0 disables), then steps. DeepSpeed reads ``_global_grad_norm`` and
    ``overflow`` after each step, so its skipped-step count and grad-norm report use ours."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, clip_grad: float, tp_rank: int, model_group,
                 expert_group=None, experts_span_tp: bool = False):
        # DeepSpeed accepts a client optimizer only if it is a torch.optim.Optimizer, so this is one,
        # initialized properly; then it shares the wrapped optimizer's groups, state and defaults (the
        # same objects), so DeepSpeed and the learning-rate schedule act on the real ones.
        super().__init__([p for group in optimizer.param_groups for p in group["params"]], optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults
        self.optimizer = optimizer
        self.clip_grad = clip_grad
        self.tp_rank = tp_rank
        self.model_group = model_group
        self.expert_group = expert_group
        self.experts_span_tp = experts_span_tp
        self._global_grad_norm: Optional[float] = None
        self.overflow = False

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)
        # torch's load_state_dict gives the wrapped optimizer NEW param_groups and state objects: share them
        # again, or the learning-rate schedule (which sets lr through this wrapper's groups) would go on
        # writing into the old ones while the wrapped optimizer steps with the lr it had at the save.
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    def _params(self):
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        params = self._params()
        norm = global_grad_norm(params, tp_rank=self.tp_rank, model_group=self.model_group,
                                expert_group=self.expert_group, experts_span_tp=self.experts_span_tp)
        self._global_grad_norm = norm
        self.overflow = not math.isfinite(norm)
        if self.overflow:
            self.optimizer.zero_grad(set_to_none=True)
            return None
        if self.clip_grad > 0 and norm > self.clip_grad:
            scale = self.clip_grad / (norm + 1e-6)
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], scale)
        return self.optimizer.step(closure)


def sync_tp_duplicated(module: torch.nn.Module, tp_group) -> None:
    """``--sync-tp-duplicated-parameters``: average the TP-replicated parameters across the TP group,
    in the module AND in the optimizer's fp32 master copies (``BF16_Optimizer`` keeps one fragment
    of each parameter per DP rank; the fragments of a replicated parameter line up across TP ranks
    because every TP rank of a stage has the same parameter shapes, hence the same flat layout)."""
    if group_size(tp_group) == 1:
        return
    sync_tp_duplicated_parameters(module, tp_group)
    masters = []
    for _, param in tp_duplicated_parameters(module):
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is not None:
            masters.append(mapping.get_hp_fragment())
    if masters:
        with torch.no_grad():
            flat = torch.cat([m.detach().reshape(-1) for m in masters])
            dist.all_reduce(flat, group=tp_group)
            flat /= group_size(tp_group)
            offset = 0
            for m in masters:
                m.copy_(flat[offset:offset + m.numel()].view_as(m))
                offset += m.numel()
