"""MoEConfig: the mixture-of-experts MLP (what replaces the dense MLP in chosen layers), and the run rules it adds.

Field names follow Megatron-LM's flags (``--num-experts``, ``--moe-router-topk``, ...) without the ``moe_``
prefix; ``megatron.arguments.moe_flags`` maps the flags (and Megatron-DeepSpeed's spellings) onto them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.config._checks import _one_of, _positive
from megatron.config.combinations import check_combinations

SCORE_FUNCTIONS = ("softmax", "sigmoid")
TOKEN_DROP_POLICIES = ("probs", "position")
# Megatron-LM's --moe-router-load-balancing-type values that run here: the Switch loss over the micro-batch, DeepSeek-V2's
# sequence-wise one, or no balancing loss.
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
# How tokens reach the experts' ranks (Megatron-LM's --moe-token-dispatcher-type): the same outputs either way.
TOKEN_DISPATCHERS = ("alltoall", "allgather")
# Megatron-LM's --moe-router-dtype: the router's logits, scores and weights, and the combine's weighted sum, in this
# dtype (None: the router in fp32 all the same, the weighted sum in the activations' dtype).
ROUTER_DTYPES = ("fp32", "fp64")


def parse_layer_freq(value: str, num_layers: int) -> tuple[bool, ...]:
    """Megatron-LM's ``--moe-layer-freq``: an int N (layer i is MoE when i % N == 0) or a pattern with one 0/1 per
    layer, written as a list (``[0,1,1,1]``) or as sums of repeated lists (``([0]*1+[1]*3)``, DeepSeek-V3's dense
    first layers). No eval: only those two forms are read."""
    text = str(value).replace(" ", "")
    if text.isdigit():
        every = int(text)
        if every < 1:
            raise ValueError(f"--moe-layer-freq {value!r}: an interval must be >= 1")
        return tuple(i % every == 0 for i in range(num_layers))
    if text.startswith("(") and text.endswith(")"):
        text = text[1:-1]
    pattern: list[int] = []
    for term in text.split("+"):
        body, _, times = term.partition("*")
        if not (body.startswith("[") and body.endswith("]")) or (times and not times.isdigit()):
            raise ValueError(f"--moe-layer-freq {value!r} is neither an int nor a pattern like '[0,1,1]' or "
                             f"'([0]*1+[1]*3)'")
        items = [item for item in body[1:-1].split(",") if item]
        if any(item not in ("0", "1") for item in items):
            raise ValueError(f"--moe-layer-freq {value!r}: a pattern holds only 0 (dense) and 1 (MoE)")
        pattern += [int(item) for item in items] * (int(times) if times else 1)
    if len(pattern) != num_layers:
        raise ValueError(f"--moe-layer-freq {value!r} gives {len(pattern)} layers but --num-layers is {num_layers}; "
                         f"write one 0/1 per layer")
    return tuple(bool(item) for item in pattern)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Top-k routed experts replacing the dense MLP of the layers ``layer_pattern`` marks.

    Routing (per token): scores = softmax(logits) or sigmoid(logits) over the experts (fp32; fp64 with
    ``router_dtype`` fp64); the top-k experts by
    scores (+ ``expert_bias`` when enabled; within the ``router_group_topk`` best of ``router_num_groups`` groups
    when set) are chosen; their weights are the chosen scores, normalised to sum 1 (softmax unless
    ``router_pre_softmax``; sigmoid when k > 1), times ``router_topk_scaling_factor``.
    """

    num_experts: int
    layer_pattern: tuple[bool, ...]          # one per layer: True = MoE MLP, False = dense MLP
    ffn_hidden_size: Optional[int] = None    # each expert's width; None: the dense MLP's
    router_topk: int = 2
    router_score_function: str = "softmax"   # softmax | sigmoid
    router_pre_softmax: bool = False         # softmax: weights are the full softmax's values (not renormalised)
    router_topk_scaling_factor: Optional[float] = None
    router_num_groups: Optional[int] = None  # group-limited routing: experts split in this many groups ...
    router_group_topk: Optional[int] = None  # ... of which each token may use this many (DeepSeek-V3: 8, 4)
    aux_loss_coeff: float = 0.0              # Switch / GShard load-balancing loss (over the micro-batch)
    seq_aux_loss_coeff: float = 0.0          # DeepSeek-V2's sequence-wise balance loss (per sequence, averaged)
    z_loss_coeff: float = 0.0                # ST-MoE router z-loss
    router_enable_expert_bias: bool = False  # aux-loss-free balancing (DeepSeek-V3): a per-expert routing bias
    router_bias_update_rate: float = 1e-3    # ... moved by this much, by sign, after each optimizer step
    shared_expert_intermediate_size: Optional[int] = None  # an always-on dense MLP beside the experts
    expert_capacity_factor: Optional[float] = None  # None: dropless; else each expert takes at most
                                             # ceil(tokens * k / experts * factor) tokens per micro-batch
    token_drop_policy: str = "probs"         # probs: keep each expert's highest-weight tokens | position: first ones
    token_dispatcher_type: str = "alltoall"  # alltoall: tokens sent to their experts' ranks | allgather: gathered
    router_dtype: Optional[str] = None       # fp32 | fp64: routing and the combine's weighted sum in it
    overlap_expert_parallel_comm: bool = False  # alltoall: the tokens in two parts, one's exchanges in flight while
                                             # the other's experts compute (moe.dispatch.alltoall_experts)
    shared_expert_overlap: bool = False      # alltoall: the shared expert computes while the tokens travel
    router_force_load_balancing: bool = False  # Megatron-LM's benchmark knob: random logits (straight-through
                                             # gradient) instead of the router's (moe.router.RandomLogits)

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether layer ``layer_number`` routes; a multi-token-prediction layer (numbered after the decoder's) has
        the decoder's last layer's kind, as Megatron-LM builds it from the last layer's spec."""
        return self.layer_pattern[min(layer_number, len(self.layer_pattern) - 1)]

    def validate(self, num_layers: int) -> "MoEConfig":
        _positive("--num-experts", self.num_experts)
        _positive("--moe-router-topk", self.router_topk)
        _positive("--moe-ffn-hidden-size", self.ffn_hidden_size, allow_none=True)
        _positive("--moe-shared-expert-intermediate-size", self.shared_expert_intermediate_size, allow_none=True)
        if len(self.layer_pattern) != num_layers or not any(self.layer_pattern):
            raise ValueError(f"--moe-layer-freq marks {sum(self.layer_pattern)} of {len(self.layer_pattern)} layers "
                             f"as MoE for --num-layers {num_layers}; mark at least one, one entry per layer")
        if self.router_topk > self.num_experts:
            raise ValueError(f"--moe-router-topk {self.router_topk} is larger than --num-experts {self.num_experts}; "
                             f"route each token to at most {self.num_experts} experts")
        _one_of("--moe-router-score-function", self.router_score_function, SCORE_FUNCTIONS)
        _one_of("--moe-token-drop-policy", self.token_drop_policy, TOKEN_DROP_POLICIES)
        _one_of("--moe-token-dispatcher-type", self.token_dispatcher_type, TOKEN_DISPATCHERS)
        if self.router_dtype is not None:
            _one_of("--moe-router-dtype", self.router_dtype, ROUTER_DTYPES)
        overlaps = [flag for flag, on in (("--overlap-moe-expert-parallel-comm", self.overlap_expert_parallel_comm),
                                          ("--moe-shared-expert-overlap", self.shared_expert_overlap)) if on]
        if overlaps and self.token_dispatcher_type != "alltoall":
            raise ValueError(f"{' and '.join(overlaps)} overlap the all-to-all dispatcher's exchanges; use "
                             f"--moe-token-dispatcher-type alltoall (not {self.token_dispatcher_type}) or drop them")
        if self.shared_expert_overlap and self.shared_expert_intermediate_size is None:
            raise ValueError("--moe-shared-expert-overlap runs the shared expert while the tokens travel, and there is "
                             "none: set --moe-shared-expert-intermediate-size or drop the flag")
        if self.expert_capacity_factor is not None and not self.expert_capacity_factor > 0:
            raise ValueError(f"--moe-expert-capacity-factor must be positive (or unset for dropless routing), "
                             f"got {self.expert_capacity_factor}")
        for name in ("aux_loss_coeff", "z_loss_coeff", "router_bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"--moe-{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.seq_aux_loss_coeff < 0:
            raise ValueError(f"--moe-aux-loss-coeff of seq_aux_loss (--moe-router-load-balancing-type) must be >= 0, "
                             f"got {self.seq_aux_loss_coeff}")
        self._validate_groups()
        return self

    def _validate_groups(self) -> None:
        groups, group_topk, e, k = self.router_num_groups, self.router_group_topk, self.num_experts, self.router_topk
        if groups is None and group_topk is None:
            return
        if groups is None or group_topk is None:
            raise ValueError("group-limited routing needs both --moe-router-num-groups and --moe-router-group-topk "
                             f"(got {groups} and {group_topk})")
        _positive("--moe-router-num-groups", groups)
        _positive("--moe-router-group-topk", group_topk)
        if e % groups or group_topk > groups:
            raise ValueError(f"--moe-router-num-groups {groups} must divide --num-experts {e} and be >= "
                             f"--moe-router-group-topk {group_topk}")
        if k % group_topk or k > group_topk * (e // groups):
            raise ValueError(f"--moe-router-topk {k} must be a multiple of --moe-router-group-topk {group_topk} and "
                             f"fit in the {group_topk} groups of {e // groups} experts a token may use")


def _check_expert_tensor_parallel(rc) -> bool:
    """The rules of --expert-tensor-parallel-size (etp); True where it is below TP (expert parallelism then folds
    over the stage's TP x DP ranks, ``megatron.parallel.state``), False where it is TP (the default)."""
    p = rc.parallel
    tp, etp, ep = p.tensor_model_parallel_size, p.expert_tp, p.expert_model_parallel_size
    _positive("--expert-tensor-parallel-size", etp)
    if etp == tp:
        return False
    if etp != 1:
        raise ValueError(f"--expert-tensor-parallel-size {etp}: only 1 (whole experts, expert parallelism over the TP "
                         f"ranks too) or the TP size {tp} (the default) are built; use one of them")
    if not rc.model.sequence_parallel:
        raise ValueError(f"--expert-tensor-parallel-size 1 with --tensor-model-parallel-size {tp} needs "
                         f"--sequence-parallel: each TP rank must hold other tokens to route (as in Megatron-LM)")
    if rc.checkpoint.universal_checkpoint:
        raise ValueError("--universal-checkpoint with --expert-tensor-parallel-size 1 below the TP size is not built "
                         "yet (the universal loader would cut each whole expert along TP): load it at the default "
                         "--expert-tensor-parallel-size (the TP size)")
    seq = p.ds_sequence_parallel_size * p.context_parallel_size
    stage = tp * seq * p.data_parallel_size
    if ep == 1 or stage % (etp * ep):
        raise ValueError(f"--expert-tensor-parallel-size 1 with --tensor-model-parallel-size {tp}: "
                         f"--expert-model-parallel-size {ep} must be above 1 and divide the {stage} ranks of a pipeline "
                         f"stage (TP {tp} x CP / Ulysses {seq} x DP {p.data_parallel_size}): expert parallelism then "
                         f"spans the TP ranks")
    return True


def routes_tp_shards(rc) -> bool:
    """Whether a run's MoE layers route each TP rank's own sequence-parallel tokens to TP-split experts
    (Megatron-LM's all-to-all order: route s / tp tokens, all-to-all over EP, all-gather the rows over TP): with
    experts, --sequence-parallel at TP > 1, the alltoall dispatcher and experts split over TP (etp = tp; etp = 1
    routes the shards to whole experts). With CP or Ulysses too, each rank routes its s / (tp x seq) tokens and the
    seq x TP ranks share the losses. Otherwise, under --sequence-parallel (the allgather dispatcher), the MoE layer
    gathers the tokens over TP on entry."""
    p, moe = rc.parallel, rc.model.moe
    tp = p.tensor_model_parallel_size
    return (moe is not None and rc.model.sequence_parallel and tp > 1 and moe.token_dispatcher_type == "alltoall"
            and p.expert_tp == tp)


def check_moe_run(rc) -> None:
    """The rules MoE adds across a ``RunConfig``'s settings: the expert-parallel layout, and what does not work
    with MoE yet (refused by name rather than run wrongly: the table in ``megatron.config.combinations``)."""
    moe, ep = rc.model.moe, rc.parallel.expert_model_parallel_size
    dp = rc.parallel.data_parallel_size
    _positive("--expert-model-parallel-size", ep)
    if moe is None:
        etp = rc.parallel.expert_tensor_parallel_size
        if etp is not None and etp != rc.parallel.tensor_model_parallel_size:
            raise ValueError(f"--expert-tensor-parallel-size {etp} needs experts: set --num-experts or drop it")
        if ep > 1:
            raise ValueError(f"--expert-model-parallel-size {ep} needs experts: set --num-experts (a multiple of "
                             f"{ep}) or drop it")
        return
    if moe.num_experts % ep:
        raise ValueError(f"--num-experts {moe.num_experts} is not divisible by --expert-model-parallel-size {ep}; "
                         f"each expert-parallel rank holds an equal share: use a divisor of {moe.num_experts}")
    if not _check_expert_tensor_parallel(rc) and dp % ep:
        raise ValueError(f"--expert-model-parallel-size {ep} does not divide the data-parallel size {dp} (world / "
                         f"(TP x PP)): expert parallelism is carved from the data-parallel ranks; use a divisor of "
                         f"{dp} or more processes")
    if moe.overlap_expert_parallel_comm and ep == 1:
        raise ValueError("--overlap-moe-expert-parallel-comm overlaps the expert-parallel all-to-all, and "
                         "--expert-model-parallel-size is 1 (no exchange): set it above 1 or drop the flag")
    check_combinations(rc, "MoE")
    check_combinations(rc, "expert parallelism")  # with ZeRO-3
