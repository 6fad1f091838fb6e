"""Collective counting: attribution to axes, the analytic formula, and one measured step."""

import pytest

from megatron.parallel.state import group_layout
from megatron.planner.comm_count import StepShape, analytic_step_counts, classify, compare
from megatron.testing import run_distributed, tiny_argv


def test_classify_uses_the_layout_groups():
    lay = group_layout(2, 2, 2)  # rank = (pp * 2 + dp) * 2 + tp
    assert classify("all_reduce", (0, 1), lay) == "tp"
    assert classify("all_reduce", (0, 2), lay) == "dp"
    assert classify("send", (1, 5), lay) == "pp"
    assert classify("send", (0, 3), lay) == "other"
    # PP = 2: the embedding group is the pipeline group; all-reduce = tied embedding, broadcast = loss
    assert classify("all_reduce", (0, 4), lay) == "embedding"
    assert classify("broadcast", (0, 4), lay) == "pp"
    assert classify("all_reduce", (0, 1, 4, 5), lay) == "model"
    assert classify("barrier", tuple(range(8)), lay) == "world"


def test_analytic_counts_follow_the_formula():
    lay = group_layout(2, 2, 2)
    shape = StepShape(seq_length=32, micro_batch_size=2, hidden_size=64, padded_vocab_size=512,
                      num_micro_batches=3)
    first = analytic_step_counts(shape, lay, 0, num_layers_on_stage=4, optimizer_group_numels=[1000, 10])
    act = 32 * 2 * 64 * 2
    # 4 per layer + the embedding's, per micro-batch
    assert first[("tp", "all_reduce")] == {"calls": 3 * 17, "bytes": 3 * 17 * act}
    assert first[("pp", "send")] == {"calls": 6, "bytes": 3 * (act // 2 + 9 * 8)}
    assert first[("dp", "all_reduce")] == {"calls": 1, "bytes": 2 * (1000 + 12)}  # 10 padded to 4 * 3
    recompute = analytic_step_counts(StepShape(32, 2, 64, 512, 3, recompute=True), lay, 0, 4, [1000, 10])
    assert recompute[("tp", "all_reduce")]["calls"] == 3 * (4 * 5 + 1)  # early-stopping replay: +1 per layer
    assert compare(first, first)["tp"]["bytes_ratio"] == 1.0


def _run(rank, world_size, argv):
    from megatron.benchmarking.measure import run_recorded

    return run_recorded(argv, world_size)


@pytest.mark.multiprocess
def test_measured_step_equals_analytic_count(tiny_corpus):
    """(TP, PP, DP) = (2, 2, 1), bf16: every axis's calls and bytes equal the formula."""
    argv = tiny_argv(tiny_corpus, train_iters=2, lr_warmup_iters=1) + [
        "--bf16", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    results = run_distributed(_run, world_size=4, args=(argv,), timeout=600)
    for r in results:
        c = r["config"]
        lay = group_layout(c["tp"], c["pp"], c["dp"])
        shape = StepShape(c["seq_length"], c["micro_batch_size"], c["hidden_size"], c["padded_vocab_size"],
                          c["global_batch_size"] // (c["micro_batch_size"] * c["dp"]))
        analytic = analytic_step_counts(shape, lay, r["rank"], r["stage_layers"], r["group_numels"])
        measured = {tuple(k.split("/")): v for k, v in r["summary"].items()}
        for key in set(analytic) | set(measured):
            m, a = measured.get(key, {}), analytic.get(key, {})
            assert (m.get("calls"), m.get("bytes")) == (a.get("calls"), a.get("bytes")), \
                f"rank {r['rank']} {key}: measured {m}, analytic {a}"


def _run_sequence_parallel(rank, world_size, runs):
    """Each argv: run_recorded's facts, plus what the SP formula needs that it does not report."""
    from megatron.arguments import run_config_from_argv
    from megatron.benchmarking.measure import run_recorded

    out = []
    for argv in runs:
        m = run_config_from_argv(argv, world_size=world_size).model
        out.append(dict(run_recorded(argv, world_size), sequence_parallel=m.sequence_parallel,
                        norm_params=2 if m.normalization == "layernorm" else 1, linear_biases=m.add_bias_linear,
                        embed_layernorm=m.embed_layernorm))
    return out


@pytest.mark.multiprocess
def test_measured_sequence_parallel_step_equals_analytic_count(tiny_corpus):
    """(TP, PP, DP) = (2, 2, 1), bf16, --sequence-parallel, with and without recomputation: all-gathers and
    reduce-scatters instead of the TP all-reduces, the norms' gradient all-reduces, whole shards over the pipe."""
    argv = tiny_argv(tiny_corpus, train_iters=2, lr_warmup_iters=1) + [
        "--bf16", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"]
    results = run_distributed(_run_sequence_parallel, world_size=4, args=([argv, argv + ["--checkpoint-activations"]],),
                              timeout=600)
    for per_rank in results:
        for r in per_rank:
            c = r["config"]
            assert r["sequence_parallel"]
            lay = group_layout(c["tp"], c["pp"], c["dp"])
            shape = StepShape(c["seq_length"], c["micro_batch_size"], c["hidden_size"], c["padded_vocab_size"],
                              c["global_batch_size"] // (c["micro_batch_size"] * c["dp"]),
                              recompute=c["checkpoint_activations"], sequence_parallel=True,
                              norm_params=r["norm_params"], linear_biases=r["linear_biases"],
                              embed_layernorm=r["embed_layernorm"])
            analytic = analytic_step_counts(shape, lay, r["rank"], r["stage_layers"], r["group_numels"])
            measured = {tuple(k.split("/")): v for k, v in r["summary"].items()}
            assert ("tp", "reduce_scatter_tensor") in measured  # the SP collectives were seen at all
            for key in set(analytic) | set(measured):
                m, a = measured.get(key, {}), analytic.get(key, {})
                assert (m.get("calls"), m.get("bytes")) == (a.get("calls"), a.get("bytes")), \
                    f"rank {r['rank']} recompute={c['checkpoint_activations']} {key}: measured {m}, analytic {a}"


def _ulysses_step(rank, world_size, config, tp, recompute):
    """One forward + backward of a GPTModel with Ulysses attention over SP = world / tp, recorded."""
    import torch

    from megatron.engine.initialize import init_deepspeed_comm
    from megatron.engine.ulysses import ulysses_exchange
    from megatron.model import GPTModel
    from megatron.parallel.random import tracked_checkpoint_func
    from megatron.parallel.state import ParallelState
    from megatron.planner.comm_count import CollectiveRecorder

    torch.set_num_threads(1)
    init_deepspeed_comm("gloo")
    state = ParallelState.create(tp=tp, pp=1, sp=world_size // tp)
    try:
        model = GPTModel(config, state, sequence_exchange=ulysses_exchange(state))
        if recompute:
            model.recompute_activations(tracked_checkpoint_func(None), 1)
        s = config.seq_length // state.sp_size
        tokens = torch.randint(0, 200, (2, s), generator=torch.Generator().manual_seed(1))
        with CollectiveRecorder(state.layout) as recorder:
            recorder.active = True
            model(tokens, torch.arange(s)[None] + state.sp_rank * s, tokens).sum().backward()
            recorder.active = False
        return {"/".join(k): {"calls": v["calls"], "bytes": v["bytes"]} for k, v in recorder.summary().items()
                if k[0] == "sp"}
    finally:
        state.destroy()


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp,sp,recompute", [(1, 2, False), (2, 2, False), (1, 2, True)])
def test_ulysses_all_to_alls_equal_analytic_count(tp, sp, recompute):
    """4 all-to-alls per layer forward (q, k, v, context), 4 adjoints backward, sizes per head count (GQA)."""
    from megatron.planner.comm_count import analytic_ulysses_counts
    from tests.helpers.model import tiny_config

    config = tiny_config(num_attention_heads=8, num_key_value_heads=4, position_embedding_type="rotary",
                         seq_length=16)
    results = run_distributed(_ulysses_step, world_size=tp * sp, args=(config, tp, recompute), timeout=120)
    shape = StepShape(config.seq_length, 2, config.hidden_size, config.padded_vocab_size, 1, activation_bytes=4,
                      recompute=recompute)
    analytic = analytic_ulysses_counts(shape, group_layout(tp, 1, 1, sp), config.num_layers,
                                       config.num_attention_heads, config.num_kv_heads, config.head_dim)
    expected = {"/".join(k): v for k, v in analytic.items()}
    assert expected["sp/all_to_all_single"]["calls"] == (12 if recompute else 8) * config.num_layers
    for rank, measured in enumerate(results):
        assert measured == expected, f"rank {rank}: measured {measured}, analytic {expected}"
