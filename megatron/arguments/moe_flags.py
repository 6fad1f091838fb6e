"""The mixture-of-experts flags (one argument group) and their step: Megatron-LM's names, with
Megatron-DeepSpeed's spellings accepted where they mean the same thing (``--moe-expert-parallel-size``,
``--topk``, ``--moe-loss-coeff``, ``--moe-train-capacity-factor``) and refused by name where they do not
(``--mlp-type residual``, several expert counts for ``--num-experts``). Megatron-LM's flags for what does not
run here are refused with their cause (``REFUSED_VALUES``: the sinkhorn and global balancing losses); its flex
dispatcher (DeepEP / HybridEP kernels) runs as alltoall, which moves the same tokens; its random routing for
benchmarks (--moe-router-force-load-balancing) is ``moe.router.RandomLogits``; its kernel choices
(``--moe-grouped-gemm``, ``--moe-permute-fusion``) are in the one table of no-effect flags
(``megatron.arguments.upstream_flags``).
"""

from __future__ import annotations

from megatron.config.moe import LOAD_BALANCING_TYPES, SCORE_FUNCTIONS, TOKEN_DROP_POLICIES, MoEConfig, parse_layer_freq

__all__ = ["add_moe_arguments", "resolve_moe", "moe_warnings"]

# Megatron-DeepSpeed's MoE flags with no equivalent here -> what to use instead.
REFUSED = {
    "--moe-eval-capacity-factor": "evaluation routes with the training capacity (--moe-expert-capacity-factor)",
    "--moe-min-capacity": "the capacity is ceil(tokens x topk / experts x --moe-expert-capacity-factor), no minimum",
    "--expert-interval": "choose the MoE layers with --moe-layer-freq (an interval or a 0/1 pattern)",
    "--use-tutel": "Tutel's kernels are not used; the experts run as grouped GEMMs (torch._grouped_mm)",
    "--moe-top2-2nd-expert-sampling": "the second expert is the second-best by score, never sampled",
}

# Megatron-LM's flag values that do not run here -> why, and what to use.
REFUSED_VALUES = {
    ("--moe-router-load-balancing-type", "sinkhorn"):
        "S-BASE's Sinkhorn routing is not implemented (the router chooses by top-k of its scores); balance with "
        "aux_loss, seq_aux_loss or --moe-router-enable-expert-bias",
    ("--moe-router-load-balancing-type", "global_aux_loss"):
        "the global-batch aux loss is not implemented (it needs the choices counted over the data-parallel ranks "
        "at every micro-batch and a running mean reset each step); use aux_loss (per micro-batch) or seq_aux_loss",
    ("--moe-router-load-balancing-type", "quantile_balancing"):
        "quantile balancing is not implemented; use --moe-router-enable-expert-bias (aux-loss-free balancing)",
}
# Megatron-LM's flex dispatcher exchanges tokens with DeepEP's or HybridEP's GPU kernels: the same tokens to the
# same experts as alltoall, which runs it here (a startup line says so).
FLEX_RUNS_AS = {"flex": "alltoall"}
LOAD_BALANCING_FLAG_VALUES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none")
# Pure kernel choices of Megatron-LM: accepted, with a startup warning that they change nothing here.


def add_moe_arguments(parser) -> None:
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, nargs="+", default=None,
                   help="Routed experts per MoE layer (unset: dense MLPs). Megatron-DeepSpeed's list form is "
                        "accepted with one value; its 1 means dense, as there.")
    g.add_argument("--expert-model-parallel-size", "--moe-expert-parallel-size", dest="expert_model_parallel_size",
                   type=int, default=1,
                   help="Ranks each MoE layer's experts are split over (carved from the data-parallel ranks: must "
                        "divide the data-parallel size and --num-experts); tokens travel by all-to-all. Default 1.")
    g.add_argument("--expert-tensor-parallel-size", dest="expert_tensor_parallel_size", type=int, default=None,
                   help="Ranks each expert's matrices are split over (Megatron-LM's flag). Default: "
                        "--tensor-model-parallel-size. 1 under TP (with --sequence-parallel): whole experts, and "
                        "expert parallelism spans the TP ranks too (etp x ep divides each stage's ranks; Megatron-LM's "
                        "expert order tp-ep-dp). Only 1 or the TP size.")
    g.add_argument("--moe-layer-freq", default="1",
                   help="Which layers are MoE: an int N (every N-th layer, from layer 0) or one 0/1 per layer, "
                        "e.g. '([0]*1+[1]*3)' for DeepSeek-V3-style dense first layers. Default 1: all.")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="Each expert's MLP width. Default: --ffn-hidden-size.")
    g.add_argument("--moe-router-topk", "--topk", dest="moe_router_topk", type=int, default=2,
                   help="Experts per token (--topk is Megatron-DeepSpeed's name). Default 2.")
    g.add_argument("--moe-router-score-function", default="softmax", choices=SCORE_FUNCTIONS,
                   help="Router scores: softmax over the experts, or a sigmoid per expert (DeepSeek-V3).")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="Softmax scores: weight the chosen experts by the full softmax's values instead of "
                        "renormalising them over the top k.")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="Multiply the top-k weights by this (DeepSeek-V3: 2.5).")
    g.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="Group-limited routing: the experts form this many groups ...")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="... and each token chooses only within its this-many best groups.")
    g.add_argument("--moe-router-load-balancing-type", nargs="+", default="aux_loss",
                   choices=LOAD_BALANCING_FLAG_VALUES,
                   help="The balancing loss(es), one --moe-aux-loss-coeff each (Megatron-LM's list form): aux_loss "
                        "(Switch/GShard, over the micro-batch; default), seq_aux_loss (DeepSeek-V2/V3: per sequence, "
                        "averaged), none. sinkhorn, global_aux_loss and quantile_balancing are refused.")
    g.add_argument("--moe-aux-loss-coeff", "--moe-loss-coeff", dest="moe_aux_loss_coeff", type=float, nargs="+",
                   default=0.0,
                   help="The balancing loss's coefficient, one per --moe-router-load-balancing-type "
                        "(--moe-loss-coeff: Megatron-DeepSpeed's). Default 0.")
    g.add_argument("--moe-z-loss-coeff", type=float, default=0.0, help="Router z-loss coefficient. Default 0.")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for the choice "
                        "only, moved after each step towards balance.")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="How far the expert bias moves per step (by the sign of the load's deviation).")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="Width of an always-on shared expert beside the routed ones. Default: none.")
    g.add_argument("--moe-expert-capacity-factor", "--moe-train-capacity-factor", dest="moe_expert_capacity_factor",
                   type=float, default=None,
                   help="Drop the choices beyond ceil(tokens x topk / experts x factor) per expert and micro-batch. "
                        "Default: dropless.")
    g.add_argument("--moe-token-drop-policy", default="probs", choices=TOKEN_DROP_POLICIES,
                   help="Which choices an expert over capacity keeps: its highest-weight ones, or the first ones.")
    g.add_argument("--moe-token-dispatcher-type", default="alltoall", choices=("alltoall", "allgather", "flex"),
                   help="How tokens reach the experts' ranks (the same outputs): alltoall sends each token to the "
                        "ranks of its experts (the default here; Megatron-LM's default is allgather); allgather "
                        "gathers every token on every expert-parallel rank and reduce-scatters the outputs. flex "
                        "(Megatron-LM's DeepEP / HybridEP kernels, NVIDIA GPU only) runs as alltoall: the same tokens "
                        "reach the same experts.")
    g.add_argument("--moe-router-dtype", default=None, choices=("fp32", "fp64"),
                   help="The dtype of the routing (logits, scores, weights) and of the combine's weighted sum of the "
                        "experts' outputs, as in Megatron-LM. Unset: the router in fp32 all the same, the weighted "
                        "sum in the activations' dtype.")
    g.add_argument("--overlap-moe-expert-parallel-comm", action="store_true",
                   help="Hide the expert-parallel all-to-all behind computation (needs --expert-model-parallel-size "
                        "> 1 and the alltoall dispatcher): each MoE layer splits the micro-batch's tokens in two "
                        "parts, one part's exchange travels while the other's experts compute, forward and backward. "
                        "Megatron-LM's flag overlaps two micro-batches in its combined 1F1B schedule instead; this "
                        "split needs no schedule of its own (every pipeline schedule here). The same sums; the "
                        "experts' GEMMs on two blocks of rows.")
    g.add_argument("--moe-shared-expert-overlap", action="store_true",
                   help="Run the shared expert while the tokens travel to their experts (alltoall dispatcher), "
                        "instead of after the routed experts, as in Megatron-LM.")
    g.add_argument("--moe-router-force-load-balancing", action="store_true",
                   help="Megatron-LM's benchmark knob: route by standard normal draws instead of the router's "
                        "logits (balanced whatever the tokens; the gradient passes straight through to the logits), "
                        "as its RandomSTE. For throughput and memory benchmarks only: the routing ignores the "
                        "tokens.")
    g.add_argument("--mlp-type", default="standard", choices=("standard", "residual"),
                   help="Megatron-DeepSpeed's PR-MoE 'residual' is not supported (use "
                        "--moe-shared-expert-intermediate-size for an always-on dense MLP beside the experts).")
    g.add_argument("--disable-moe-token-dropping", action="store_true",
                   help="Megatron-DeepSpeed's flag for dropless routing, the default here (no capacity factor).")
    g.add_argument("--create-moe-param-group", action="store_true",
                   help="Accepted for Megatron-DeepSpeed compatibility: with expert parallelism the experts always "
                        "have optimizer groups of their own.")
    for flag in REFUSED:
        g.add_argument(flag, default=None, help=f"Megatron-DeepSpeed's; refused here: {REFUSED[flag]}.")


def resolve_moe(args) -> None:
    """``args.moe``: the MoEConfig the flags describe (None: dense), or ValueError for flags meaning what is not
    here."""
    if args.mlp_type == "residual":
        raise ValueError("--mlp-type residual (Megatron-DeepSpeed's PR-MoE: a dense MLP mixed with the experts by a "
                         "learned coefficient) is not supported; use --moe-shared-expert-intermediate-size for a "
                         "dense shared expert added to the routed ones")
    given = [flag for flag in REFUSED if getattr(args, flag[2:].replace("-", "_")) is not None]
    if given:
        raise ValueError("; ".join(f"{flag} is not supported: {REFUSED[flag]}" for flag in given))
    refused = [f"{flag} {value}: {why}" for (flag, value), why in REFUSED_VALUES.items() if value in _given(args, flag)]
    if refused:
        raise ValueError("; ".join(refused))
    coeffs = _balancing_coefficients(_given(args, "--moe-router-load-balancing-type"),
                                     _given(args, "--moe-aux-loss-coeff"))
    if args.disable_moe_token_dropping and args.moe_expert_capacity_factor is not None:
        raise ValueError(f"--disable-moe-token-dropping contradicts --moe-expert-capacity-factor "
                         f"{args.moe_expert_capacity_factor} (--moe-train-capacity-factor); drop one")
    counts = args.num_experts
    if counts is not None and len(counts) > 1:
        raise ValueError(f"--num-experts {' '.join(map(str, counts))}: per-layer expert counts (Megatron-DeepSpeed's "
                         f"list form) are not supported; give one count and choose the MoE layers with "
                         f"--moe-layer-freq")
    if counts is None or counts[0] == 1:
        args.moe = None
        return
    args.moe = MoEConfig(
        num_experts=counts[0], layer_pattern=parse_layer_freq(args.moe_layer_freq, args.num_layers),
        ffn_hidden_size=args.moe_ffn_hidden_size, router_topk=args.moe_router_topk,
        router_score_function=args.moe_router_score_function, router_pre_softmax=args.moe_router_pre_softmax,
        router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        router_num_groups=args.moe_router_num_groups, router_group_topk=args.moe_router_group_topk,
        aux_loss_coeff=coeffs.get("aux_loss", 0.0), seq_aux_loss_coeff=coeffs.get("seq_aux_loss", 0.0),
        z_loss_coeff=args.moe_z_loss_coeff,
        router_enable_expert_bias=args.moe_router_enable_expert_bias,
        router_bias_update_rate=args.moe_router_bias_update_rate,
        shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        expert_capacity_factor=args.moe_expert_capacity_factor, token_drop_policy=args.moe_token_drop_policy,
        token_dispatcher_type=FLEX_RUNS_AS.get(args.moe_token_dispatcher_type, args.moe_token_dispatcher_type),
        router_dtype=args.moe_router_dtype,
        overlap_expert_parallel_comm=args.overlap_moe_expert_parallel_comm,
        shared_expert_overlap=args.moe_shared_expert_overlap,
        router_force_load_balancing=args.moe_router_force_load_balancing)


def _given(args, flag: str) -> list:
    """The values given for ``flag`` (a list flag's, or a one-value flag's as a list)."""
    value = getattr(args, flag[2:].replace("-", "_"))
    return value if isinstance(value, list) else [value]


def _balancing_coefficients(types: list[str], coeffs: list[float]) -> dict[str, float]:
    """{load-balancing type: its coefficient} from Megatron-LM's two lists (one type: one coefficient)."""
    if len(set(types)) != len(types):
        raise ValueError(f"--moe-router-load-balancing-type {' '.join(types)} names a type twice; name each once")
    if len(coeffs) != len(types):
        raise ValueError(f"--moe-aux-loss-coeff gives {len(coeffs)} coefficient(s) for {len(types)} "
                         f"--moe-router-load-balancing-type(s) ({' '.join(types)}); give one per type, in order")
    assert all(t in LOAD_BALANCING_TYPES for t in types), types  # the others are refused above
    return dict(zip(types, coeffs))


def moe_warnings(args) -> list[str]:
    """The startup warnings of MoE flags accepted with no effect here."""
    out = []
    ignored = [c for t, c in zip(_given(args, "--moe-router-load-balancing-type"), _given(args, "--moe-aux-loss-coeff"))
               if t == "none" and c]
    if ignored:
        out.append(f"--moe-aux-loss-coeff {ignored[0]} has no effect with --moe-router-load-balancing-type none "
                   f"(no balancing loss)")
    if args.moe_token_dispatcher_type in FLEX_RUNS_AS:
        out.append(f"--moe-token-dispatcher-type {args.moe_token_dispatcher_type} (Megatron-LM's DeepEP / HybridEP "
                   f"kernels) runs as {FLEX_RUNS_AS[args.moe_token_dispatcher_type]} here: the same tokens reach the "
                   f"same experts, the outputs are the same")
    return out
