"""The MoE MLP on one process against a plain re-implementation written here from the formulas: the router's
choices, weights, aux and z losses (softmax / sigmoid, group-limited, expert bias), DeepSeek-V2's sequence-wise
balance loss (and its parts over 2 sequence shards), capacity dropping (which choices each policy keeps, counted),
the whole layer's output and gradients (GeLU / SwiGLU, shared expert), the expert-bias update, and the
configuration errors."""

import dataclasses
import math

import pytest
import torch

from megatron.config.moe import MoEConfig, parse_layer_freq
from megatron.model.moe import MoELayer, route, set_aux_loss_scale, update_expert_biases
from megatron.model.moe.dispatch import combine, dispatch, expert_capacity, kept_choices, plan_dispatch
from megatron.model.moe.router import aux_loss, balance_choices, seq_aux_loss, sequence_counts, z_loss
from megatron.testing.tolerance import tolerance
from tests.helpers.model import tiny_config

TOKENS, EXPERTS = 24, 8
# fp32 against the float64 formulas below (megatron.testing.tolerance), each number on its own size:
# a routing weight: the scores (softmax: shift, exp, sum, division), their renormalization over the chosen
# experts (sum, division) and the scaling factor; summing over the experts.
WEIGHT_DEPTH = 7
# the aux loss: the scores (4), their normalization (2), the mean over the tokens (2), the product with each
# expert's load and the sum over the experts (2), the coefficient (1); summing over the tokens.
AUX_DEPTH = 11
# the z loss: the log-sum-exp (shift, exp, sum, log), its square, the mean over the tokens (2), the coefficient.
Z_DEPTH = 8
# The layer against the loop: the router's product, the scores and their renormalization (6), the expert's two
# products and its activation (4), the weighting and the sum over the chosen experts (2), the shared expert's
# sum; the longest sum is over the hidden size (64). Gradients: one product back through each of them and the
# weight gradient's own.
LAYER_DEPTH = 13
LAYER_GRAD_DEPTH = 2 * LAYER_DEPTH + 1
HIDDEN = 64


def _assert_losses_match(aux_got: float, z_got: float, aux: float, z: float, tokens: int) -> None:
    aux_diff, z_diff = abs(aux_got - aux), abs(z_got - z)
    assert aux_diff <= tolerance(torch.float32, AUX_DEPTH, tokens, abs(aux)), (aux_got, aux)
    assert z_diff <= tolerance(torch.float32, Z_DEPTH, tokens, abs(z)), (z_got, z)


def _assert_close_to(got: torch.Tensor, expected: torch.Tensor, depth: int, what: str) -> None:
    diff = (got - expected).abs().max().item()
    assert diff <= tolerance(torch.float32, depth, HIDDEN, expected.abs().max().item()), (what, diff)


def moe_config(**overrides) -> MoEConfig:
    fields = dict(num_experts=EXPERTS, layer_pattern=(True, True), router_topk=2)
    fields.update(overrides)
    return MoEConfig(**fields).validate(2)


# ---- the plain reference: one token at a time, Python lists --------------------------------------------------

def reference_route(logits, cfg, bias=None):
    """(choices, weights) per token, from the formulas in megatron/model/moe/router.py's docstring."""
    choices, weights = [], []
    for row in logits.double().tolist():
        if cfg.router_score_function == "softmax":
            top = max(row)
            exps = [math.exp(v - top) for v in row]
            scores = [e / sum(exps) for e in exps]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in row]
        steer = [s + (0.0 if bias is None else float(bias[e])) for e, s in enumerate(scores)]
        allowed = range(len(row))
        if cfg.router_num_groups:
            size = len(row) // cfg.router_num_groups
            per = cfg.router_topk // cfg.router_group_topk
            group_score = [sum(sorted(steer[g * size:(g + 1) * size], reverse=True)[:per])
                           for g in range(cfg.router_num_groups)]
            best = sorted(range(cfg.router_num_groups), key=lambda g: -group_score[g])[:cfg.router_group_topk]
            allowed = [e for e in range(len(row)) if e // size in best]
        chosen = sorted(allowed, key=lambda e: -steer[e])[:cfg.router_topk]
        w = [scores[e] for e in chosen]
        if (cfg.router_score_function == "softmax" and not cfg.router_pre_softmax) or \
                (cfg.router_score_function == "sigmoid" and cfg.router_topk > 1):
            w = [v / sum(w) for v in w]
        w = [v * (cfg.router_topk_scaling_factor or 1.0) for v in w]
        choices.append(chosen)
        weights.append(w)
    return choices, weights


def reference_balance_choices(logits, cfg):
    """The choices the balancing losses count: each token's top-k experts by score alone, without the expert bias
    and the group limit (DeepSeek-V3 eq. 19: 1(s_it in Topk({s_jt}, K)))."""
    return reference_route(logits, dataclasses.replace(cfg, router_num_groups=None, router_group_topk=None))[0]


def _reference_balance_inputs(logits, cfg, choices):
    """What the balancing losses count and weigh: the choices (by score alone where a bias or groups steer the
    routed ones) and the scores normalised per token, in float64."""
    if cfg.router_enable_expert_bias or cfg.router_num_groups:
        choices = reference_balance_choices(logits, cfg)
    scores = torch.softmax(logits.double(), -1) if cfg.router_score_function == "softmax" else \
        torch.sigmoid(logits.double())
    return choices, scores / scores.sum(-1, keepdim=True)


def reference_aux_and_z(logits, cfg, choices):
    """``choices``: the routed ones; f counts ``reference_balance_choices`` (the same without a bias or groups)."""
    choices, scores = _reference_balance_inputs(logits, cfg, choices)
    num_tokens, num_experts = logits.shape
    load = [sum(row.count(e) for row in choices) / (num_tokens * cfg.router_topk) for e in range(num_experts)]
    aux = cfg.aux_loss_coeff * num_experts * sum(load[e] * scores[:, e].mean().item() for e in range(num_experts))
    z = cfg.z_loss_coeff * sum(torch.logsumexp(row, 0).item() ** 2 for row in logits.double()) / num_tokens
    return aux, z


ROUTER_CASES = {
    "softmax": {},
    "softmax-pre": dict(router_pre_softmax=True),
    "sigmoid-scaled": dict(router_score_function="sigmoid", router_topk_scaling_factor=2.5),
    "softmax-top1": dict(router_topk=1),
    "sigmoid-groups": dict(router_score_function="sigmoid", router_topk=4, router_num_groups=4, router_group_topk=2),
    "softmax-groups-bias": dict(router_num_groups=2, router_group_topk=1, router_enable_expert_bias=True),
    "sigmoid-bias": dict(router_score_function="sigmoid", router_enable_expert_bias=True),
}


@pytest.mark.parametrize("case", ROUTER_CASES)
def test_router_matches_the_formulas(case):
    cfg = moe_config(aux_loss_coeff=0.01, z_loss_coeff=1e-3, **ROUTER_CASES[case])
    logits = torch.randn(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(0)) * 2
    bias = torch.linspace(-0.3, 0.3, EXPERTS) if cfg.router_enable_expert_bias else None
    routing = route(logits, cfg, bias)
    choices, weights = reference_route(logits, cfg, bias)
    assert routing.expert_index.tolist() == choices
    expected = torch.tensor(weights, dtype=torch.float64)
    weight_diff = (routing.weight.double() - expected).abs().max().item()
    assert weight_diff <= tolerance(torch.float32, WEIGHT_DEPTH, EXPERTS, expected.abs().max().item()), weight_diff
    aux, z = reference_aux_and_z(logits, cfg, choices)
    _assert_losses_match(aux_loss(routing, cfg).item(), z_loss(routing, cfg).item(), aux, z, TOKENS)
    if bias is not None:  # the bias steers: without it some choice differs, the weights stay the scores'
        assert route(logits, cfg).expert_index.tolist() != choices


@pytest.mark.parametrize("case", ["softmax", "sigmoid-groups-bias"])
def test_two_token_shards_add_up_to_the_whole_micro_batchs_losses(case):
    """Context parallelism / Ulysses: each of 2 ranks holds half the tokens; its aux part (f_e from the choices
    counted over both, P_e over its own tokens) and z part (coefficient halved) sum to the whole micro-batch's
    losses, and each part's gradient on its own logits is the whole losses' gradient on those rows."""
    overrides = {"softmax": {}, "sigmoid-groups-bias": dict(ROUTER_CASES["sigmoid-groups"],
                                                            router_enable_expert_bias=True)}[case]
    cfg = moe_config(aux_loss_coeff=0.01, z_loss_coeff=1e-3, **overrides)
    logits = (torch.randn(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(1)) * 2).requires_grad_()
    bias = torch.linspace(-0.3, 0.3, EXPERTS) if cfg.router_enable_expert_bias else None
    whole = route(logits, cfg, bias)
    (aux_loss(whole, cfg) + z_loss(whole, cfg)).backward()
    expected_grad, logits.grad = logits.grad, None
    shards = [route(part, cfg, bias) for part in logits.chunk(2)]
    counts = sum(torch.bincount(balance_choices(r, cfg).flatten(), minlength=EXPERTS) for r in shards)
    auxes = [aux_loss(r, cfg, counts, shards=2) for r in shards]
    zs = [z_loss(r, cfg, shards=2) for r in shards]
    _assert_losses_match(float(sum(auxes)), float(sum(zs)), aux_loss(whole, cfg).item(), z_loss(whole, cfg).item(),
                         TOKENS)
    (sum(auxes) + sum(zs)).backward()
    # one gradient entry: the aux loss's depth, plus the z loss's (the two add)
    diff = (logits.grad - expected_grad).abs().max().item()
    assert diff <= tolerance(torch.float32, AUX_DEPTH + Z_DEPTH, TOKENS, expected_grad.abs().max().item()), diff
    assert auxes[0].item() != auxes[1].item()  # the parts differ: each holds its own tokens' share


SEQUENCES = 3  # the micro-batch: SEQUENCES sequences of TOKENS / SEQUENCES positions, laid out [s, b]


def reference_seq_aux(logits, cfg, choices, batch):
    """DeepSeek-V2 (arXiv:2405.04434) eq. 12-14 per sequence, averaged over the sequences (Megatron-LM's
    seq_aux_loss): L = alpha * sum_i f_i P_i, f_i = E / (K T) * #(tokens of the sequence choosing i),
    P_i = 1 / T * sum_t s'_it, s' the scores normalised per token (DeepSeek-V3 eq. 18 for sigmoid); with an
    expert bias or group-limited routing, "choosing" is the top-k by score alone (DeepSeek-V3 eq. 19)."""
    choices, scores = _reference_balance_inputs(logits, cfg, choices)
    num_tokens, num_experts = logits.shape
    losses = []
    for j in range(batch):
        tokens = list(range(j, num_tokens, batch))  # position i of sequence j is token i * batch + j
        t = len(tokens)
        f = [num_experts / (cfg.router_topk * t) * sum(choices[u].count(e) for u in tokens)
             for e in range(num_experts)]
        p = [sum(scores[u, e].item() for u in tokens) / t for e in range(num_experts)]
        losses.append(cfg.seq_aux_loss_coeff * sum(fe * pe for fe, pe in zip(f, p)))
    return sum(losses) / batch


@pytest.mark.parametrize("case", ["softmax", "sigmoid-groups", "sigmoid-bias"])
def test_sequence_wise_aux_loss_matches_deepseek_v2(case):
    cfg = moe_config(seq_aux_loss_coeff=1e-2, **ROUTER_CASES[case])
    logits = torch.randn(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(2)) * 2
    bias = torch.linspace(-0.3, 0.3, EXPERTS) if cfg.router_enable_expert_bias else None
    routing = route(logits, cfg, bias)
    choices, _ = reference_route(logits, cfg, bias)
    expected = reference_seq_aux(logits, cfg, choices, SEQUENCES)
    got = seq_aux_loss(routing, cfg, SEQUENCES).item()
    assert abs(got - expected) <= tolerance(torch.float32, AUX_DEPTH, TOKENS, abs(expected)), (got, expected)
    # per sequence, not over the micro-batch: the Switch loss of the same choices differs
    whole = reference_aux_and_z(logits, moe_config(aux_loss_coeff=1e-2, **ROUTER_CASES[case]), choices)[0]
    assert abs(whole - expected) > tolerance(torch.float32, AUX_DEPTH, TOKENS, abs(expected))
    assert seq_aux_loss(routing, moe_config(**ROUTER_CASES[case]), SEQUENCES).item() == 0.0


def test_two_sequence_shards_add_up_to_the_whole_sequence_wise_aux_loss():
    """Context parallelism / Ulysses: 2 ranks hold the first and second halves of every sequence; with the
    per-sequence counts summed over both, their parts add up to the whole loss, and their gradients on their own
    logits are the whole loss's on those rows."""
    cfg = moe_config(seq_aux_loss_coeff=1e-2)
    positions = TOKENS // SEQUENCES
    logits = (torch.randn(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(3)) * 2).requires_grad_()
    whole = route(logits, cfg)
    seq_aux_loss(whole, cfg, SEQUENCES).backward()
    expected_grad, logits.grad = logits.grad, None
    halves = logits.view(positions, SEQUENCES, EXPERTS).chunk(2)  # [s/2, b, E] each
    shards = [route(half.reshape(-1, EXPERTS), cfg) for half in halves]
    counts = sum(sequence_counts(r.expert_index, EXPERTS, SEQUENCES) for r in shards)
    assert counts.tolist() == sequence_counts(whole.expert_index, EXPERTS, SEQUENCES).tolist()
    parts = [seq_aux_loss(r, cfg, SEQUENCES, counts, shards=2) for r in shards]
    expected = seq_aux_loss(whole, cfg, SEQUENCES).item()
    assert abs(sum(parts).item() - expected) <= tolerance(torch.float32, AUX_DEPTH, TOKENS, expected)
    sum(parts).backward()
    diff = (logits.grad - expected_grad).abs().max().item()
    assert diff <= tolerance(torch.float32, AUX_DEPTH, TOKENS, expected_grad.abs().max().item()), diff
    assert parts[0].item() != parts[1].item()
    # each shard's own counts alone would give another loss: the sum over the group is needed
    alone = sum(seq_aux_loss(r, cfg, SEQUENCES, shards=2) for r in shards).item()
    assert abs(alone - expected) > tolerance(torch.float32, AUX_DEPTH, TOKENS, expected)


def test_force_load_balancing_routes_by_random_logits_with_a_straight_through_gradient():
    """--moe-router-force-load-balancing (Megatron-LM's RandomSTE): the router routes by standard normal draws of the
    default generator (what torch.randn draws from the same state), whatever the tokens, and the loss's gradient
    reaches the router weight as if the draws were its logits: dL/dW = (dL/d draws)^T x."""
    cfg = moe_config(router_force_load_balancing=True, router_score_function="sigmoid", router_topk=3)
    router = MoELayer(tiny_config(moe=cfg), layer_number=0).router
    tokens = torch.randn(TOKENS, 64, generator=torch.Generator().manual_seed(3))
    state = torch.get_rng_state()
    routing = router(tokens)
    torch.set_rng_state(state)
    drawn = torch.randn(TOKENS, EXPERTS).requires_grad_()
    reference = route(drawn, cfg)
    assert routing.expert_index.tolist() == reference.expert_index.tolist()
    assert torch.equal(routing.weight, reference.weight)  # the same function of the same numbers
    torch.set_rng_state(state)
    assert router(tokens * 3 + 1).expert_index.tolist() == reference.expert_index.tolist()  # the tokens play no part
    scale = torch.linspace(0.5, 2.0, cfg.router_topk)
    (routing.weight * scale).sum().backward()
    (grad,) = torch.autograd.grad((reference.weight * scale).sum(), drawn)
    expected = grad.t() @ tokens
    bound = tolerance(torch.float32, 1, TOKENS, expected.abs().max().item())  # two [E, T] x [T, h] products
    assert (router.weight.grad - expected).abs().max().item() <= bound
    assert router.weight.grad.abs().max().item() > 0
    plain = MoELayer(tiny_config(moe=moe_config(router_score_function="sigmoid", router_topk=3)), layer_number=0)
    assert plain.router(tokens).expert_index.tolist() != reference.expert_index.tolist()  # the logits' own routing


def test_fp64_router_dtype_routes_in_float64():
    """--moe-router-dtype fp64: the weights within float64's tolerance of the float64 formulas (fp32 routing is
    not), and the router's own logits in float64."""
    cfg = moe_config(router_dtype="fp64")
    logits = torch.randn(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(8), dtype=torch.float64) * 2
    choices, weights = reference_route(logits, cfg)
    expected = torch.tensor(weights, dtype=torch.float64)
    bound = tolerance(torch.float64, WEIGHT_DEPTH, EXPERTS, expected.abs().max().item())
    routing = route(logits, cfg)
    assert routing.weight.dtype == torch.float64 and routing.expert_index.tolist() == choices
    assert (routing.weight - expected).abs().max().item() <= bound
    assert (route(logits, moe_config()).weight.double() - expected).abs().max().item() > bound
    layer = MoELayer(tiny_config(moe=cfg), layer_number=0)
    assert layer.router(torch.randn(4, 64)).logits.dtype == torch.float64


def test_the_router_keeps_its_bf16_input_not_an_fp32_copy():
    """In a bf16 run the router computes in fp32 but keeps its input in bf16 for backward (as Megatron-LM's
    RouterGatingLinearFunction): no fp32 copy of the tokens is saved, and the logits and both gradients are those
    of the plain linear on the fp32 copy, bit for bit (the same products)."""
    from megatron.model.moe import TopKRouter
    from megatron.parallel.weight_grad_store import linear

    router = TopKRouter(moe_config(), HIDDEN, lambda w: torch.nn.init.normal_(w, std=0.1,
                                                                               generator=torch.Generator().manual_seed(3)))
    tokens = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(4)).bfloat16().requires_grad_()
    g = torch.randn(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(5))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logits = router(tokens).logits
    assert not [t for t in saved if t.dtype == torch.float32 and t.shape == tokens.shape]
    assert logits.dtype == torch.float32
    logits.backward(g)
    grads = tokens.grad.clone(), router.weight.grad.clone()
    tokens.grad = router.weight.grad = None
    plain = linear(tokens.float(), router.weight, None, None)
    plain.backward(g)
    assert torch.equal(logits, plain)
    assert torch.equal(grads[0], tokens.grad) and torch.equal(grads[1], router.weight.grad)


def test_router_dtype_weights_and_sums_the_expert_outputs_in_it():
    """--moe-router-dtype fp32 with bf16 activations: the routing weights travel to the experts in fp32 (the weighting
    inside their activation runs in it) and the combine's sum runs in fp32, rounded to bf16 once (as Megatron-LM's
    unpermute in the router dtype); without it the weights travel in bf16."""
    cfg = moe_config(router_topk=4)
    gen = torch.Generator().manual_seed(9)
    routing = route(torch.randn(TOKENS, EXPERTS, generator=gen), cfg)
    plan = plan_dispatch(routing, cfg)
    tokens = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16()
    rows, weight = dispatch(tokens, plan, dtype=torch.float32)
    assert rows.dtype == torch.bfloat16 and weight.dtype == torch.float32
    assert torch.equal(weight, plan.weight.float()[plan.local_order])  # one rank: the sorted order, regrouped
    assert dispatch(tokens, plan)[1].dtype == torch.bfloat16
    rows = torch.randn(plan.order.numel(), HIDDEN, generator=gen).bfloat16()  # the experts' weighted outputs
    received = rows.double()[torch.argsort(plan.local_order)]  # back in the sorted-by-expert order
    exact = torch.zeros(TOKENS, HIDDEN, dtype=torch.float64).index_add(0, plan.token, received)
    fp32 = combine(rows, plan, TOKENS, dtype=torch.float32)
    bf16 = combine(rows, plan, TOKENS)
    assert fp32.dtype == bf16.dtype == torch.bfloat16
    # one rounding to bf16 of an fp32 sum of 4 rows
    fp32_err = (fp32.double() - exact).abs().max().item()
    assert fp32_err <= tolerance(torch.bfloat16, 1, cfg.router_topk, exact.abs().max().item()), fp32_err


def test_group_limited_routing_stays_in_the_chosen_groups():
    cfg = moe_config(router_topk=4, router_num_groups=4, router_group_topk=2)
    routing = route(torch.randn(64, EXPERTS, generator=torch.Generator().manual_seed(1)), cfg)
    groups = (routing.expert_index // 2).tolist()
    assert max(len(set(row)) for row in groups) == 2
    # without the limit, some token would have used experts of three or four groups
    free = route(torch.randn(64, EXPERTS, generator=torch.Generator().manual_seed(1)), moe_config(router_topk=4))
    assert max(len(set(row)) for row in (free.expert_index // 2).tolist()) > 2


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_exactly_what_the_policy_says(policy):
    cfg = moe_config(expert_capacity_factor=0.5, token_drop_policy=policy)
    logits = torch.randn(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(2))
    logits[:, 3] += 3.0  # expert 3 is everyone's favourite: it must drop
    routing = route(logits, cfg)
    capacity = expert_capacity(TOKENS, cfg)
    assert capacity == math.ceil(TOKENS * 2 / EXPERTS * 0.5) == 3
    kept = kept_choices(routing, cfg).view(TOKENS, 2).tolist()
    choices, weights = routing.expert_index.tolist(), routing.weight.tolist()
    for expert in range(EXPERTS):
        mine = [(t, j) for t in range(TOKENS) for j in range(2) if choices[t][j] == expert]
        if policy == "probs":
            mine.sort(key=lambda tj: -weights[tj[0]][tj[1]])
        expected = set(mine[:capacity])
        got = {(t, j) for (t, j) in mine if kept[t][j]}
        assert got == expected, f"expert {expert}"
    dropped = sum(not k for row in kept for k in row)
    assert dropped == sum(max(0, sum(row.count(e) for row in choices) - capacity) for e in range(EXPERTS)) > 0


def reference_layer(layer: MoELayer, x: torch.Tensor, swiglu: bool, keep=None):
    """The layer's output from its own weights, one token and one choice at a time."""
    cfg = layer.config
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ layer.router.weight.T
    choices, _ = reference_route(logits.detach(), cfg, layer.router.expert_bias)
    scores = torch.softmax(logits, -1) if cfg.router_score_function == "softmax" else torch.sigmoid(logits)
    out = []
    for t, chosen in enumerate(choices):
        w = scores[t, chosen]
        w = w / w.sum() if cfg.router_score_function == "softmax" else w
        acc = torch.zeros_like(tokens[t])
        for j, e in enumerate(chosen):
            if keep is not None and not keep[t][j]:
                continue
            e_w1, e_w2 = layer.experts.w1[e], layer.experts.w2[e]
            hidden = e_w1 @ tokens[t] + (layer.experts.fc1_bias[e] if layer.experts.fc1_bias is not None else 0)
            if swiglu:
                hidden = torch.nn.functional.silu(hidden[0::2]) * hidden[1::2]
            else:
                hidden = torch.nn.functional.gelu(hidden, approximate="tanh")
            y = e_w2 @ hidden + (layer.experts.fc2_bias[e] if layer.experts.fc2_bias is not None else 0)
            acc = acc + w[j] * y
        out.append(acc)
    out = torch.stack(out).view_as(x)
    if layer.shared_expert is not None:
        out = out + layer.shared_expert(x)
    aux, z = reference_aux_and_z(logits.detach(), cfg, choices)
    aux_t = cfg.aux_loss_coeff * cfg.num_experts * sum(
        sum(row.count(e) for row in choices) / (len(choices) * cfg.router_topk) * scores[:, e].mean()
        for e in range(cfg.num_experts))
    z_t = cfg.z_loss_coeff * torch.logsumexp(logits, -1).square().mean()
    _assert_losses_match(aux_t.item(), z_t.item(), aux, z, len(choices))
    return out, aux_t + z_t


@pytest.mark.parametrize("swiglu,shared,bias", [(False, False, True), (True, True, False)])
def test_layer_output_and_gradients_match_the_plain_loop(swiglu, shared, bias):
    cfg = moe_config(aux_loss_coeff=0.01, z_loss_coeff=1e-3, shared_expert_intermediate_size=32 if shared else None)
    model = tiny_config(moe=cfg, swiglu=swiglu, ffn_hidden_size=48, add_bias_linear=bias)
    from megatron.model.transformer import TransformerLayer

    layer = TransformerLayer(model, layer_number=1).mlp
    with torch.no_grad():
        for p in layer.parameters():  # non-zero biases, so that they are checked too
            if p.dim() == 2 and p.shape[0] == EXPERTS and p.shape[1] != 64:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    x = torch.randn(6, 4, 64, generator=torch.Generator().manual_seed(4), requires_grad=True)
    g = torch.randn(6, 4, 64, generator=torch.Generator().manual_seed(5))
    set_aux_loss_scale(layer, 0.25)
    out = layer(x)
    (out * g).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    x_grad = x.grad.clone()
    layer.zero_grad()
    x.grad = None
    ref, losses = reference_layer(layer, x, swiglu)
    ((ref * g).sum() + 0.25 * losses).backward()
    _assert_close_to(out, ref, LAYER_DEPTH, "output")
    _assert_close_to(x_grad, x.grad, LAYER_GRAD_DEPTH, "input gradient")
    for name, p in layer.named_parameters():
        _assert_close_to(grads[name], p.grad, LAYER_GRAD_DEPTH, name)


def test_dropping_layer_matches_the_plain_loop_without_the_dropped_choices():
    cfg = moe_config(expert_capacity_factor=0.75)
    layer = MoELayer(tiny_config(moe=cfg), layer_number=0)
    x = torch.randn(8, 3, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        routing = layer.router(x.reshape(-1, 64))
        keep = kept_choices(routing, cfg).view(-1, 2).tolist()
        ref, _ = reference_layer(layer, x, swiglu=False, keep=keep)
        _assert_close_to(layer(x), ref, LAYER_DEPTH, "output")
    assert sum(not k for row in keep for k in row) > 0


def test_expert_bias_moves_towards_balance_outside_the_gradient():
    cfg = moe_config(router_enable_expert_bias=True, router_bias_update_rate=0.01)
    layer = MoELayer(tiny_config(moe=cfg), layer_number=0)
    x = torch.randn(8, 4, 64, generator=torch.Generator().manual_seed(7))
    layer(x)
    layer(x)
    logits = (x.reshape(-1, 64) @ layer.router.weight.T).detach()
    choices, _ = reference_route(logits, cfg)
    load = [2 * sum(row.count(e) for row in choices) for e in range(EXPERTS)]
    assert layer.router.tokens_per_expert.tolist() == load
    assert update_expert_biases(layer) == 1
    mean = sum(load) / EXPERTS
    expected = [0.01 * ((mean > n) - (mean < n)) for n in load]
    # Exact: 0 + 0.01 x sign(mean - load) is the fp32 cast of 0.01 (or 0); the loads and their mean (a sum of
    # integers over 8) are exact in fp32.
    assert layer.router.expert_bias.tolist() == torch.tensor(expected, dtype=torch.float32).tolist()
    assert layer.router.tokens_per_expert.sum() == 0
    assert "router.expert_bias" in layer.state_dict() and not layer.router.expert_bias.requires_grad
    layer.to(torch.bfloat16)
    assert layer.router.expert_bias.dtype == torch.float32  # 1e-3 steps would vanish in bf16


def test_layer_freq_patterns():
    assert parse_layer_freq("2", 4) == (True, False, True, False)
    assert parse_layer_freq("([0]*1+[1]*3)", 4) == (False, True, True, True)
    assert parse_layer_freq("[1,0,1]", 3) == (True, False, True)
    with pytest.raises(ValueError, match="one 0/1 per layer"):
        parse_layer_freq("[0]*2+[1]*1", 4)
    with pytest.raises(ValueError, match="neither an int nor a pattern"):
        parse_layer_freq("__import__('os')", 4)


@pytest.mark.parametrize("overrides,match", [
    (dict(router_topk=9), "--moe-router-topk 9 is larger than --num-experts 8"),
    (dict(router_num_groups=3, router_group_topk=1), "must divide --num-experts 8"),
    (dict(router_num_groups=4), "needs both"),
    (dict(router_score_function="relu"), "is not one of softmax, sigmoid"),
    (dict(expert_capacity_factor=0.0), "must be positive"),
])
def test_bad_moe_settings_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        moe_config(**overrides)


def test_expert_width_must_split_over_tensor_parallel_ranks():
    with pytest.raises(ValueError, match="--moe-ffn-hidden-size 30 is not divisible by --tensor-model-parallel-size 4"):
        tiny_config(moe=moe_config(ffn_hidden_size=30)).validate(4)


def test_flops_count_the_routed_experts_and_the_router():
    """An all-MoE model (top-2 of 8 GeLU experts of width 48) costs per token what a dense model of MLP width
    2 x 48 + 8 / 2 (the router's E x h matrix over 2 matrices) costs; a half-MoE model the mean of the two."""
    moe = tiny_config(moe=moe_config(ffn_hidden_size=48), ffn_hidden_size=256)
    assert moe.flops_per_iteration(8, False) == tiny_config(ffn_hidden_size=100).flops_per_iteration(8, False)
    half = tiny_config(moe=moe_config(ffn_hidden_size=48, layer_pattern=(False, True)), ffn_hidden_size=256)
    assert half.mlp_flops_width == (256 + 100) / 2


# ---- the local experts alone: unpadded segments (torch._grouped_mm) and the padded bmm against plain torch ----

# An expert: its first product (and bias), the activation (SwiGLU: silu and the product with up), the second
# product and bias. Gradients: one product back through each and the weight gradient's own.
EXPERT_DEPTH = 5
EXPERT_GRAD_DEPTH = 2 * EXPERT_DEPTH + 1


def _experts(num: int, hidden: int, ffn: int, swiglu: bool, bias: bool, dtype: torch.dtype):
    from megatron.model.moe.experts import GroupedExperts

    def init(e, std):
        return lambda t: t.normal_(0, std, generator=torch.Generator().manual_seed(10 + e))

    experts = GroupedExperts(hidden, ffn, range(num), swiglu=swiglu, bias=bias, w1_init=lambda e: init(e, 0.2),
                             w2_init=lambda e: init(e + num, 0.2))
    with torch.no_grad():
        for p in (experts.fc1_bias, experts.fc2_bias):
            if p is not None:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(7))
    return experts.to(dtype)


def _reference_experts(weights: dict, rows: torch.Tensor, counts: list, swiglu: bool) -> torch.Tensor:
    """Plain float64 torch on ``weights`` (name -> tensor), one expert's slice of rows at a time."""
    outs, start = [], 0
    w1, w2, b1, b2 = (weights.get(name) for name in ("w1", "w2", "fc1_bias", "fc2_bias"))
    for e, n in enumerate(counts):
        x = rows[start:start + n]
        hidden = x @ w1[e].double().T
        if b1 is not None:
            hidden = hidden + b1[e].double()
        if swiglu:
            hidden = torch.nn.functional.silu(hidden[:, 0::2]) * hidden[:, 1::2]  # rows interleaved gate, up
        else:
            hidden = torch.nn.functional.gelu(hidden, approximate="tanh")
        y = hidden @ w2[e].double().T
        outs.append(y + b2[e].double() if b2 is not None else y)
        start += n
    return torch.cat(outs)


def _expert_grads(experts, rows, counts, g, path: str, store=None):
    experts.path = path
    experts.zero_grad(set_to_none=True)
    x = rows.detach().clone().requires_grad_()
    out = experts(x, torch.tensor(counts))
    (out * g).sum().backward()
    if store is not None:
        assert all(p.grad is None for p in (experts.w1, experts.w2))  # deferred to the W pass
        store.close_micro_batch()
        store.run_oldest()
    return out.detach(), x.grad, {name: p.grad.clone() for name, p in experts.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("swiglu,bias", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("counts", [[5, 0, 9, 2], [0, 0, 16, 0], [1, 6, 3, 7]])
def test_unpadded_and_padded_experts_match_plain_torch_per_expert(dtype, swiglu, bias, counts):
    from megatron.parallel.weight_grad_store import WeightGradStore, defer_weight_grads

    hidden, ffn = 32, 48
    experts = _experts(len(counts), hidden, ffn, swiglu, bias, dtype)
    rows = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(8)).to(dtype)
    g = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(9)).to(dtype)
    assert experts.uses_segments(rows)  # aligned: h 32, W1 rows 96 / 48, fp 48
    x = rows.double().requires_grad_()
    params = {name: p.detach().double().requires_grad_() for name, p in experts.named_parameters()}
    ref = _reference_experts(params, x, counts, swiglu)
    (ref * g.double()).sum().backward()

    def close(got, expected, depth, what):
        bound = tolerance(dtype, depth, ffn, expected.abs().max().item())
        diff = (got.double() - expected).abs().max().item()
        assert diff <= bound, (what, diff, bound)

    runs = {"segments": _expert_grads(experts, rows, counts, g, "segments"),
            "padded": _expert_grads(experts, rows, counts, g, "padded")}
    store = WeightGradStore()
    defer_weight_grads(experts, store)
    runs["segments_deferred"] = _expert_grads(experts, rows, counts, g, "segments", store)
    store.assert_empty()
    for path, (out, x_grad, grads) in runs.items():
        close(out, ref, EXPERT_DEPTH, f"{path} output")
        close(x_grad, x.grad, EXPERT_GRAD_DEPTH, f"{path} input gradient")
        for name, grad in grads.items():
            close(grad, params[name].grad, EXPERT_GRAD_DEPTH, f"{path} {name}")
            if name in ("w1", "w2"):  # an empty expert's weight gradient is exactly zero, not left-over memory
                for e, n in enumerate(counts):
                    assert n or not grads[name][e].any(), (path, name, e)
    # the deferred W pass runs the same products as the immediate backward
    for name, grad in runs["segments"][2].items():
        assert torch.equal(grad, runs["segments_deferred"][2][name]), name


def test_misaligned_experts_fall_back_to_the_padded_bmm():
    counts = [3, 0, 4]
    experts = _experts(3, 6, 10, True, False, torch.float32)  # h 6: rows of 24 bytes, not a multiple of 16
    rows = torch.randn(7, 6, generator=torch.Generator().manual_seed(8))
    assert not experts.uses_segments(rows)
    with pytest.raises(ValueError, match="_grouped_mm does not run here"):
        experts.path = "segments"
        experts.uses_segments(rows)
    experts.path = "auto"
    out = experts(rows, torch.tensor(counts))
    ref = _reference_experts(dict(experts.named_parameters()), rows.double(), counts, True)
    assert (out.double() - ref).abs().max().item() <= tolerance(torch.float32, EXPERT_DEPTH, 10, ref.abs().max().item())
