"""ZeRO-2 / ZeRO-3 / hpZ: the data-parallel collectives of a measured step equal megatron.planner.comm_zero's count."""

import json

import pytest

from megatron.benchmarking.measure import analytic_sharded_counts
from megatron.planner.comm_zero import ModuleParams, ZeroSettings, analytic_zero_counts
from megatron.testing import run_distributed, tiny_argv

# stage3_max_reuse_distance 0: every parameter released after each use; prefetch 0: one call per module
RELEASE = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
KEEP = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0}


def test_bucket_and_shard_arithmetic():
    modules = ModuleParams(pre=[("embedding.word_embeddings", (1000,))], layers=[[("a", (10, 3)), ("b", (7,))]],
                           post=[("final", (5,))], tied_embedding="embedding.word_embeddings")
    z2 = analytic_zero_counts(ZeroSettings(2, reduce_bucket_size=12), modules, [1017, 8], dp=2, tp=1,
                              num_micro_batches=3, param_bytes=2)
    # reversed gradients 5, 7, 3, 10, 1000 in buckets of 12: [5, 7] [3] [10] [1000]
    assert z2[("dp", "all_reduce")] == {"calls": 3 * 4 + 3, "bytes": 3 * 1025 * 2 + 12}
    assert z2[("dp", "all_gather_into_tensor")] == {"calls": 2, "bytes": 2 * (1020 // 2 + 8 // 2)}  # padded to 4
    release = ZeroSettings(3, param_persistence_threshold=4, max_reuse_distance=0, prefetch_bucket_size=0)
    z3 = analytic_zero_counts(release, modules, [1025], dp=2, tp=1, num_micro_batches=1, param_bytes=4)
    # fetched: 1000, (10 [3 persists]), 7, 5 -> shards 500, 5, 4, 3: forward 4 calls (512) + the head 1 (500),
    # backward 3 (12); after the step the persistent 3 alone (2)
    assert z3[("dp", "all_gather_into_tensor")] == {"calls": 4 + 1 + 3 + 1, "bytes": 4 * (512 + 500 + 12 + 2)}
    assert z3[("dp", "reduce_scatter_tensor")] == {"calls": 1, "bytes": 4 * (1000 + 10 + 4 + 8 + 6)}
    with pytest.raises(ValueError, match="stage3_max_reuse_distance"):
        analytic_zero_counts(ZeroSettings(3, max_reuse_distance=10), modules, [1025], 2, 1, 1, 4)


def _run(rank, world_size, runs):
    import torch

    from megatron.benchmarking.measure import run_recorded

    torch.set_num_threads(1)
    return [run_recorded(argv, world_size, record_call=3) for argv in runs]  # after the trace checks of step 2


def _check(results, names, runs):
    from megatron.arguments import run_config_from_argv
    from megatron.config.deepspeed import build_deepspeed_config

    for per_rank in results:
        for name, r in zip(names, per_rank):
            # the planner's reading of the config we write = what the engine ran with
            rc = run_config_from_argv(runs[name], world_size=len(results))
            planned = ZeroSettings.from_deepspeed_config(build_deepspeed_config(rc, rc.deepspeed_user_config))
            assert planned == ZeroSettings(**r["zero"]["settings"]), name
            expected = analytic_sharded_counts(r)
            measured = {tuple(k.split("/")): v for k, v in r["summary"].items()}
            for key in set(expected) | set(measured):
                m, a = measured.get(key, {}), expected.get(key, {})
                calls = m.get("calls") if a.get("calls", 0) is not None else None  # prefetching: bytes only
                assert (calls, m.get("bytes")) == (a.get("calls"), a.get("bytes")), \
                    f"{name} rank {r['rank']} {key}: measured {m}, analytic {a}"


def _config(tmp_path, name, zero):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"zero_optimization": zero}))
    return ["--deepspeed_config", str(path)]


@pytest.mark.multiprocess
def test_zero_dp2_measured_equals_analytic(tiny_corpus, tmp_path):
    """DP=2: ZeRO-2 fp32 and bf16 (small buckets), ZeRO-3 default / keep / release / release + recompute; and SP=2
    (Ulysses, DP=1): ZeRO-2, ZeRO-3 release + recompute."""
    base = tiny_argv(tiny_corpus, train_iters=3, lr_warmup_iters=1)
    runs = {"zero2_fp32": base + ["--zero-stage", "2"],
            "zero2_bf16_buckets": base + ["--zero-stage", "2", "--bf16"]
            + _config(tmp_path, "b", {"reduce_bucket_size": 20000}),
            "zero3_default": base + ["--zero-stage", "3"],
            "zero3_prefetch": base + ["--zero-stage", "3"]
            + _config(tmp_path, "p", {"stage3_param_persistence_threshold": 0}),
            "zero3_keep": base + ["--zero-stage", "3"] + _config(tmp_path, "k", KEEP),
            "zero3_release_bf16": base + ["--zero-stage", "3", "--bf16"] + _config(tmp_path, "r", RELEASE),
            "zero3_release_recompute": base + ["--zero-stage", "3", "--checkpoint-activations"]
            + _config(tmp_path, "rr", RELEASE),
            # Ulysses at DP 1: ZeRO shards over the two SP ranks, beside the all-to-alls on the same group
            "sp2_zero2": base + ["--ds-sequence-parallel-size", "2", "--zero-stage", "2"],
            "sp2_zero3_release_recompute": base + ["--ds-sequence-parallel-size", "2", "--zero-stage", "3",
                                                   "--checkpoint-activations"] + _config(tmp_path, "ur", RELEASE)}
    results = run_distributed(_run, world_size=2, args=(list(runs.values()),), timeout=600)
    assert all(r["optimizer"] == "DeepSpeedZeroOptimizer_Stage3" for r in results[0][2:7] + results[0][8:])
    _check(results, list(runs), runs)


@pytest.mark.multiprocess
def test_zero3_tp2_and_hpz_measured_equals_analytic(tiny_corpus, tmp_path):
    """4 ranks: ZeRO-3 TP=2 x DP=2 bf16 (with ZeRO-2 for its TP norms), hpZ groups of 2 over DP=4 with 1 and 2
    micro-batches per step, and Ulysses SP=2 x DP=2 with ZeRO-3, without and with hpZ groups of 2 (the SP pairs)."""
    base = tiny_argv(tiny_corpus, train_iters=3, lr_warmup_iters=1)
    runs = {"zero3_tp2_bf16": base + ["--zero-stage", "3", "--bf16", "--tensor-model-parallel-size", "2"]
            + _config(tmp_path, "r", RELEASE),
            "zero2_tp2_bf16": base + ["--zero-stage", "2", "--bf16", "--tensor-model-parallel-size", "2"],
            "hpz2_dp4": base + ["--zero-stage", "3", "--zero-hpz-partition-size", "2"] + _config(tmp_path, "h", RELEASE),
            # 2 micro-batches: the second forward gathers the secondary shards too
            "hpz2_dp4_accumulate": base + ["--zero-stage", "3", "--zero-hpz-partition-size", "2", "--global-batch-size",
                                           "16"] + _config(tmp_path, "h", RELEASE),
            # Ulysses: ZeRO-3 shards over dp x sp, hpZ groups of the two SP ranks of a replica
            "sp2_dp2_zero3": base + ["--ds-sequence-parallel-size", "2", "--zero-stage", "3"]
            + _config(tmp_path, "u", RELEASE),
            "sp2_dp2_hpz2": base + ["--ds-sequence-parallel-size", "2", "--zero-stage", "3",
                                    "--zero-hpz-partition-size", "2"] + _config(tmp_path, "uh", RELEASE)}
    results = run_distributed(_run, world_size=4, args=(list(runs.values()),), timeout=600)
    assert any(k.startswith("hpz/") for k in results[0][2]["summary"])  # the secondary gathers were seen
    _check(results, list(runs), runs)
