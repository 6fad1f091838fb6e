"""The planner's MoE accounting against the model: expert parameters per rank equal the numel of the expert
parameters each rank of a real EP x TP layout holds; the all-to-all bytes each rank hands
megatron/parallel/all_to_all.py's exchange in a forward + backward equal the planner's count given the routing
the layer measured (exact), and summed over the EP group equal the planner's dropless figure (exact: every choice
is sent once and received once); bad expert layouts are refused; the DeepSeek-V3-shaped plan on 256 H100s."""

import dataclasses
import re

import pytest
import torch

from megatron.planner import CLUSTERS, GPUS, MODEL_SIZES, Layout, estimate_memory, model_shape_of, plan_layouts
from megatron.planner.memory import stage_expert_param_counts, stage_param_counts, static_bytes
from megatron.planner.moe import MoEShape, exchange_bytes, layer_bytes
from megatron.testing import run_distributed
from megatron.testing.tolerance import tolerance

# The planner's formulas and the ones written out here are both Python float64 arithmetic of a dozen or so
# operations, in other orders: within 16 roundings in sequence of float64, nothing summed wider
# (megatron.testing.tolerance), relative. Python's float arithmetic is the same on every CPU.
F64 = tolerance(torch.float64, 16, 1)

TOKENS_PER_RANK = 16 * 2  # seq 16 x micro-batch 2


def moe_model_config(**overrides):
    from megatron.config.moe import MoEConfig
    from tests.helpers.model import tiny_config

    moe = MoEConfig(num_experts=4, layer_pattern=(False, True, True), ffn_hidden_size=48, router_topk=2,
                    shared_expert_intermediate_size=32, aux_loss_coeff=0.01)
    fields = dict(num_layers=3, hidden_size=32, swiglu=True, moe=moe.validate(3))
    fields.update(overrides)
    return tiny_config(**fields)


def test_expert_parameters_per_rank_equal_the_models_on_one_process():
    """EP = TP = 1, with biases (GeLU) and without (SwiGLU), a dense first layer and a shared expert."""
    from megatron.model import GPTModel
    from megatron.model.moe import is_expert_parallel

    for config in (moe_model_config(), moe_model_config(swiglu=False, add_bias_linear=True)):
        model = GPTModel(config)
        shape, layout = model_shape_of(config), Layout(1, 1, 1, 2)
        experts = sum(p.numel() for p in model.parameters() if is_expert_parallel(p))
        assert stage_expert_param_counts(shape, layout) == [experts]
        assert stage_param_counts(shape, layout) == [sum(p.numel() for p in model.parameters())]
        assert shape.total_params() == sum(p.numel() for p in model.parameters())


def test_expert_optimizer_state_is_sharded_over_the_expert_data_parallel_group():
    """bf16 ZeRO-1 at DP 8, EP 4: the experts' masters and Adam states over DP / EP = 2 ranks, the rest over 8."""
    shape = model_shape_of(moe_model_config())
    layout = Layout(1, 1, 8, 2, ep=4)
    n, e = stage_param_counts(shape, layout)[0], stage_expert_param_counts(shape, layout)[0]
    got = static_bytes(n, layout, e)
    assert got["master"] == pytest.approx(4 * (n - e) / 8 + 4 * e / 2, rel=F64, abs=0)
    assert got["adam"] == pytest.approx(8 * (n - e) / 8 + 8 * e / 2, rel=F64, abs=0)
    assert got["weights"] == 2 * n and got["grad_buffer"] == 4 * n


@pytest.mark.parametrize("layout,match", [
    (dict(dp=4, ep=3), "--expert-model-parallel-size 3 does not divide the data-parallel size 4"),
    (dict(dp=6, ep=3), "4 experts are not divisible by expert-parallel size 3"),
])
def test_bad_expert_layouts_are_refused(layout, match):
    shape = model_shape_of(moe_model_config())
    with pytest.raises(ValueError, match=re.escape(match)):
        estimate_memory(shape, Layout(tp=1, pp=1, micro_batch_size=1, **layout), 16, 2 * layout["dp"])


def test_bad_expert_shapes_and_sizes_are_refused():
    with pytest.raises(ValueError, match=re.escape("top-k 5 is larger than the 4 experts")):
        MoEShape(4, 5, 64, (True,))
    with pytest.raises(ValueError, match=re.escape("expert-parallel sizes [3] do not divide the 256 experts")):
        plan_layouts(MODEL_SIZES["deepseek-v3"], GPUS["H100-80GB"], CLUSTERS["dgx-h100"], 256, 4096, 1024,
                     ep_sizes=(1, 3))
    with pytest.raises(ValueError, match=re.escape("need an MoE model")):
        plan_layouts(MODEL_SIZES["llama-2-7b"], GPUS["H100-80GB"], CLUSTERS["dgx-h100"], 8, 4096, 64, ep_sizes=(2,))


def test_all_to_all_formula():
    """One MoE layer, one micro-batch: 2 (N + M) rows of h values, the M routing weights received and the N
    weights' gradients returned, and the forward's E counts; the planner's dropless figure is N = M = T k, of which
    (e - 1) / e crosses ranks."""
    # the rows both ways, the 14 received rows' routing weights (twice with recomputation) and the 10 sent rows'
    # weight gradients, the counts
    assert exchange_bytes(10, 14, 32, 4, num_experts=4) == 2 * 24 * 32 * 4 + 24 * 4 + 8 * 4
    assert exchange_bytes(10, 14, 32, 4, num_experts=4, recompute=True) == 3 * 24 * 32 * 4 + 38 * 4 + 2 * 8 * 4
    moe = MoEShape(256, 8, 2048, (True,))
    one = layer_bytes(moe, 4096, 7168, 2, ep=8)
    assert one["handed"] == (4 * 7168 + 2) * 4096 * 8 * 2 + 8 * 256 and one["calls"] == 7
    assert one["cross_rank"] == (4 * 7168 + 2) * 4096 * 8 * 2 * 7 / 8
    assert layer_bytes(moe, 4096, 7168, 2, ep=1)["handed"] == 0
    capped = layer_bytes(dataclasses.replace(moe, capacity_factor=0.5), 4096, 7168, 2, ep=8)
    assert capped["handed"] < one["handed"]


def test_deepseek_v3_shape_on_256_h100s():
    """DeepSeek-V3's 671B parameters (with MLA: tests/planner/test_llama_shapes.py); the plan docs/parallelism.md
    quotes fits and uses EP."""
    shape = MODEL_SIZES["deepseek-v3"]
    assert round(shape.total_params() / 1e9) == 671
    plans = plan_layouts(shape, GPUS["H100-80GB"], CLUSTERS["dgx-h100"], 256, 4096, 1024, zero_stages=(1,),
                         micro_batch_sizes=(1, 2), ep_sizes=(1, 2, 4, 8, 16, 32, 64))
    best = plans[0]
    assert best.fits and best.layout.ep > 1, best.layout.short()
    assert (best.layout.tp, best.layout.pp, best.layout.dp, best.layout.ep) == (4, 32, 2, 2), best.layout.short()


def _route_and_record(rank, world_size, tp, ep, recompute, sequence_parallel=False):
    """A tiny MoE GPTModel on (TP, EP) = (tp, ep) over DP = world / tp: one forward + backward on this rank's own
    tokens, its all-to-all calls recorded (the EP group's; under ``sequence_parallel`` the TP group's apart: the
    experts' rows gathered over TP); each MoE forward's rows sent and received; its expert numel."""
    import torch

    import megatron.model.moe.dispatch as moe_dispatch
    from megatron.engine.initialize import init_deepspeed_comm
    from megatron.model import GPTModel
    from megatron.model.moe import is_expert_parallel
    from megatron.parallel.random import tracked_checkpoint_func
    from megatron.parallel.state import ParallelState
    from megatron.planner.comm_count import CollectiveRecorder

    torch.set_num_threads(1)
    init_deepspeed_comm("gloo")
    state = ParallelState.create(tp=tp, pp=1, ep=ep, moe_tp_shards=sequence_parallel)
    routed = []
    plan_dispatch = moe_dispatch.plan_dispatch

    def recording_plan(*args, **kwargs):
        plan = plan_dispatch(*args, **kwargs)
        routed.append((sum(plan.send_splits), sum(plan.recv_splits)))
        return plan

    moe_dispatch.plan_dispatch = recording_plan
    try:
        config = moe_model_config(sequence_parallel=sequence_parallel)
        model = GPTModel(config, state)
        if recompute:
            model.recompute_activations(tracked_checkpoint_func(None), 1)
        tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(state.dp_rank))
        with CollectiveRecorder(state.layout) as recorder:
            recorder.active = True
            model(tokens, torch.arange(16)[None], tokens).sum().backward()
            recorder.active = False
        exchanges = [r for r in recorder.records if r.op == "all_to_all_single"]
        return {"all_to_all_bytes": sum(r.nbytes for r in exchanges if r.axis != "tp"),
                "tp_all_to_all_bytes": sum(r.nbytes for r in exchanges if r.axis == "tp"),
                "routed": routed, "expert_numel": sum(p.numel() for p in model.parameters() if is_expert_parallel(p)),
                "numel": sum(p.numel() for p in model.parameters()), "ep_rank": state.ep_rank, "tp_rank": state.tp_rank}
    finally:
        moe_dispatch.plan_dispatch = plan_dispatch
        state.destroy()


def _both_recomputations(rank, world_size):
    return [_route_and_record(rank, world_size, 2, 2, recompute) for recompute in (False, True)] + [
        _route_and_record(rank, world_size, 2, 2, False, sequence_parallel=True)]


@pytest.fixture(scope="module")
def ep_runs():
    """(TP, EP, DP) = (2, 2, 2) on 4 processes, without and with full recomputation, and with sequence parallelism
    (one launch)."""
    return run_distributed(_both_recomputations, world_size=4, timeout=600)


@pytest.mark.multiprocess
def test_measured_all_to_all_bytes_equal_the_planners_count(ep_runs):
    config = moe_model_config()
    shape = model_shape_of(config)
    planner = layer_bytes(shape.moe, TOKENS_PER_RANK, config.hidden_size, 4, ep=2)
    for recompute in (False, True):
        runs = [per_rank[recompute] for per_rank in ep_runs]
        for rank, run in enumerate(runs):
            forwards = 2 if recompute else 1
            assert len(run["routed"]) == forwards * shape.moe.num_moe_layers, run["routed"]
            # exact, given the rows this rank's router sent and its experts received (the replay routes the same)
            first = run["routed"][:shape.moe.num_moe_layers]
            # the backward replays the layers last first, routing each as its first forward did
            assert run["routed"][len(first):][::-1] in ([], first), run["routed"]
            expected = sum(exchange_bytes(sent, received, config.hidden_size, 4, num_experts=4, recompute=recompute)
                           for sent, received in first)
            assert run["all_to_all_bytes"] == expected, f"rank {rank} recompute={recompute}"
            assert all(sent == TOKENS_PER_RANK * 2 for sent, _ in run["routed"]), "dropless: every choice is sent"
        # over one EP group every choice is received once: the group's bytes are EP x the planner's figure
        for tp_rank in (0, 1):
            group = [r for r in runs if r["tp_rank"] == tp_rank]
            layers = shape.moe.num_moe_layers
            figure = layer_bytes(shape.moe, TOKENS_PER_RANK, config.hidden_size, 4, 2, recompute)["handed"]
            assert sum(r["all_to_all_bytes"] for r in group) == 2 * layers * figure, f"TP rank {tp_rank}"
    assert planner["handed"] == (4 * config.hidden_size + 2) * TOKENS_PER_RANK * 2 * 4 + 8 * 4


@pytest.mark.multiprocess
def test_expert_parameters_per_rank_equal_the_models_at_ep2_tp2(ep_runs):
    shape = model_shape_of(moe_model_config())
    layout = Layout(tp=2, pp=1, dp=2, micro_batch_size=2, ep=2)
    for rank, (run, *_) in enumerate(ep_runs):
        assert run["expert_numel"] == stage_expert_param_counts(shape, layout)[0], f"rank {rank}"
        assert run["numel"] == stage_param_counts(shape, layout)[0], f"rank {rank}"
    assert {(run["ep_rank"], run["tp_rank"]) for run, *_ in ep_runs} == {(0, 0), (0, 1), (1, 0), (1, 1)}


@pytest.mark.multiprocess
def test_sequence_parallel_sends_each_tp_ranks_own_tokens(ep_runs):
    """Under --sequence-parallel each TP rank routes its own s / tp tokens (Megatron-LM's order): the EP group's
    all-to-all carries half the rows of the gathered run at TP = 2, as the planner and the dry run count them
    (layer_bytes at s / tp tokens); the experts then gather the TP ranks' rows over TP."""
    from megatron.planner import estimate_step

    config = moe_model_config()
    shape, layers = model_shape_of(config), model_shape_of(config).moe.num_moe_layers
    mine = TOKENS_PER_RANK // 2
    for rank, (gathered, _, run) in enumerate(ep_runs):
        assert all(sent == mine * 2 for sent, _ in run["routed"]), (rank, run["routed"])  # dropless, top-2
        expected = sum(exchange_bytes(sent, received, config.hidden_size, 4, num_experts=4)
                       for sent, received in run["routed"])
        assert run["all_to_all_bytes"] == expected, rank
        assert run["tp_all_to_all_bytes"] > 0 and gathered["tp_all_to_all_bytes"] == 0, rank
    for tp_rank in (0, 1):
        group = [run for _, _, run in ep_runs if run["tp_rank"] == tp_rank]
        figure = layer_bytes(shape.moe, mine, config.hidden_size, 4, 2)["handed"]
        assert sum(r["all_to_all_bytes"] for r in group) == 2 * layers * figure, f"TP rank {tp_rank}"
    # the planner's step time counts the all-to-all at s / tp tokens under sequence parallelism
    gpu, cluster, seq = GPUS["H100-80GB"], CLUSTERS["dgx-h100"], 64
    times = {sp: estimate_step(shape, Layout(tp=2, pp=1, dp=4, micro_batch_size=2, ep=2, recompute=False,
                                             sequence_parallel=sp), gpu,
                               cluster, seq, 16).components_s["moe_all_to_all"] for sp in (False, True)}
    for sp, tokens in ((False, seq * 2), (True, seq)):  # micro-batch 2: s x 2 tokens, or s / 2 x 2 per TP rank
        one = layer_bytes(shape.moe, tokens, shape.hidden_size, 2, 2)
        per_micro_batch = layers * (one["cross_rank"] / (gpu.nvlink_busbw_gbps * 1e9)
                                    + one["calls"] * cluster.collective_latency_us * 1e-6)
        assert times[sp] == pytest.approx(2 * per_micro_batch, rel=F64, abs=0), sp  # 2 micro-batches, PP 1


def test_expert_parallelism_is_proposed_with_ulysses_on_its_own_tokens():
    """Ulysses x EP runs (tests/training/test_moe_sequence.py), so the planner proposes it; each rank routes its
    s / u tokens of each sample: the all-to-all time is layer_bytes' for s / u x b tokens, and the experts'
    optimizer state is sharded over the DP x u / EP ranks that hold the same experts."""
    from megatron.planner import estimate_step
    from megatron.planner.search import candidate_layouts

    shape = model_shape_of(moe_model_config())
    gpu, cluster, seq = GPUS["H100-80GB"], CLUSTERS["dgx-h100"], 64
    layouts = candidate_layouts(shape, 8, 8, 16, micro_batch_sizes=(2,), recompute=(False,), zero_stages=(1,),
                                ulysses_sizes=(1, 2), ep_sizes=(1, 2))
    both = [lay for lay in layouts if lay.ulysses == 2 and lay.ep == 2 and lay.tp == 1]
    assert both, sorted({(lay.ulysses, lay.ep) for lay in layouts})
    lay = both[0]
    assert (lay.dp, lay.expert_replicas, lay.pp) == (4, 4, 1)
    got = estimate_step(shape, lay, gpu, cluster, seq, 16).components_s["moe_all_to_all"]
    one = layer_bytes(shape.moe, seq // 2 * 2, shape.hidden_size, 2, 2)
    per_micro_batch = shape.moe.num_moe_layers * (one["cross_rank"] / (gpu.nvlink_busbw_gbps * 1e9)
                                                  + one["calls"] * cluster.collective_latency_us * 1e-6)
    expected = lay.num_micro_batches(16) * per_micro_batch  # PP 1: no bubble
    assert got == pytest.approx(expected, rel=F64, abs=0)
    whole = layer_bytes(shape.moe, seq * 2, shape.hidden_size, 2, 2)["cross_rank"]
    assert one["cross_rank"] == whole / 2  # half the tokens, half the bytes
