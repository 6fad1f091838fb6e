"""tools/plan_parallelism.py: the table and --json agree with the library's ranking."""

import json

import pytest

from tools import plan_parallelism

BLOOM_ARGS = ["--model", "176B", "--num-gpus", "384", "--gpu", "A100-80GB", "--cluster", "jean-zay-a100",
              "--global-batch-size", "2048", "--pp-partition-method", "type:transformer|embedding"]


def test_json_rows_are_ranked_and_fit(capsys):
    assert plan_parallelism.main(BLOOM_ARGS + ["--json", "--top", "5", "--recompute", "yes"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["layouts"]
    assert len(rows) == 5 and out["num_feasible"] >= 5
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    assert all(r["fits"] and r["memory_gib"] <= 72 for r in rows)
    assert (rows[0]["tp"], rows[0]["pp"], rows[0]["dp"], rows[0]["micro_batch_size"]) == (4, 12, 8, 2)


def test_table_and_no_fit_exit_code(capsys):
    assert plan_parallelism.main(BLOOM_ARGS + ["--top", "3"]) == 0
    table = capsys.readouterr().out
    assert table.count("\n") >= 5 and "TFLOPs hw" in table
    assert plan_parallelism.main(["--model", "176B", "--num-gpus", "8", "--gpu", "A100-40GB",
                                  "--global-batch-size", "512"]) == 1


def test_longest_sequence_json_parses_and_is_the_librarys(capsys):
    from megatron.planner import BLOOM_SIZES, CLUSTERS, GPUS
    from megatron.planner.search import longest_sequences

    argv = ["--model", "7B1", "--num-gpus", "8", "--gpu", "A100-80GB", "--global-batch-size", "8",
            "--longest-sequence", "--ulysses-sizes", "1", "2", "4", "8", "--zero-stages", "0", "1", "2", "3",
            "--attention", "fused"]
    assert plan_parallelism.main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = longest_sequences(BLOOM_SIZES["7B1"], GPUS["A100-80GB"], CLUSTERS["dgx-a100"], 8, 8,
                                 store_attention_scores=False)
    assert [(r["family"], r["recompute"], r["seq_length"]) for r in out["longest"]] == \
        [(r.family, r.recompute, r.seq_length) for r in expected]
    for r in out["longest"]:
        lay = r["layout"]
        assert lay["fits"] and lay["tp"] * lay["pp"] * lay["dp"] * lay["ulysses"] == 8, r
        assert ("SP" in r["family"]) or not lay["sequence_parallel"]
    assert plan_parallelism.main(argv) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 3 + 8 and table[3].split()[:3] == ["3D/ZeRO", "no", str(out["longest"][0]["seq_length"])]


def test_ranking_with_sp_and_ulysses_counts_every_gpu(capsys):
    argv = ["--model", "llama-2-7b", "--num-gpus", "16", "--gpu", "H100-80GB", "--global-batch-size", "64",
            "--seq-length", "16384", "--ulysses-sizes", "1", "2", "4", "--json", "--top", "200"]
    assert plan_parallelism.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert all(r["tp"] * r["pp"] * r["dp"] * r["ulysses"] == 16 for r in rows)
    assert {r["ulysses"] for r in rows} == {1, 2, 4} and {r["sequence_parallel"] for r in rows} == {False, True}
    assert plan_parallelism.main(argv[:-2] + ["--sequence-parallel", "off"]) == 0
    assert not any(r["sequence_parallel"] for r in json.loads(capsys.readouterr().out)["layouts"])


LLAMA3_70B_128K = ["--model", "llama-3-70b", "--num-gpus", "64", "--gpu", "H100-80GB", "--cluster", "dgx-h100",
                   "--seq-length", "131072", "--global-batch-size", "32", "--micro-batch-sizes", "1",
                   "--sequence-parallel", "both", "--json", "--top", "500"]


def test_context_parallel_sizes_are_searched_and_count_every_gpu(capsys):
    """--cp-sizes: ring layouts at any PP, never beside Ulysses, TP x PP x DP x CP the GPUs, ZeRO sharding over
    DP x CP (hpZ groups cut from those ranks), the sequence divisible by 2 x CP."""
    argv = ["--model", "llama-2-7b", "--num-gpus", "16", "--gpu", "H100-80GB", "--global-batch-size", "64",
            "--seq-length", "16384", "--cp-sizes", "1", "2", "4", "--ulysses-sizes", "1", "2", "--json", "--top", "500"]
    assert plan_parallelism.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert all(r["tp"] * r["pp"] * r["dp"] * r["ulysses"] * r["cp"] == 16 for r in rows)
    assert {r["cp"] for r in rows} == {1, 2, 4} and not any(r["cp"] > 1 and r["ulysses"] > 1 for r in rows)
    assert any(r["cp"] > 1 and r["pp"] > 1 for r in rows)  # the ring runs on the pipeline engine too
    assert all(r["sequence"].endswith(f"CP{r['cp']}") for r in rows if r["cp"] > 1)
    # ZeRO over one rank has nothing to shard; at DP 1 x CP 2 it shards over the CP pair
    assert any(r["cp"] == 2 and r["dp"] == 1 and r["zero_stage"] == 3 for r in rows)


def test_llama_3_70b_at_128k_on_64_h100s_needs_a_split_sequence_and_the_ring_when_scores_are_kept(capsys):
    """docs/parallelism.md's answer: with the [heads, s, s] scores kept for backward (--attention materialized),
    nothing fits at 128k on 64 H100s without context parallelism (Ulysses keeps its heads' scores over the whole
    sequence; the ring keeps none); with the ring, layouts fit; with a fused attention kernel the best Ulysses and CP
    layouts come within 2% of each other."""
    assert plan_parallelism.main(LLAMA3_70B_128K + ["--ulysses-sizes", "1", "2", "4", "8"]) == 1
    assert json.loads(capsys.readouterr().out)["num_feasible"] == 0
    assert plan_parallelism.main(LLAMA3_70B_128K + ["--cp-sizes", "1", "2", "4", "8", "16"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert rows[0]["fits"] and all(r["cp"] > 1 for r in rows if r["fits"])
    fused = LLAMA3_70B_128K + ["--attention", "fused", "--cp-sizes", "1", "2", "4", "8", "16",
                               "--ulysses-sizes", "1", "2", "4", "8"]
    assert plan_parallelism.main(fused) == 0
    rows = [r for r in json.loads(capsys.readouterr().out)["layouts"] if r["fits"]]
    best_ulysses = min(r["step_s"] for r in rows if r["ulysses"] > 1)
    best_cp = min(r["step_s"] for r in rows if r["cp"] > 1)
    assert abs(best_cp - best_ulysses) <= 0.02 * min(best_cp, best_ulysses), (best_cp, best_ulysses)


def test_an_moe_model_is_searched_over_expert_parallel_sizes(capsys):
    """Mixtral-8x7B: by default EP 1, 2, 4 and 8 (the powers of two dividing its 8 experts), each a divisor of DP
    (EP ranks are carved from the data-parallel ones); --ep-sizes narrows the search; a dense model refuses it."""
    argv = ["--model", "mixtral-8x7b", "--num-gpus", "64", "--gpu", "H100-80GB", "--seq-length", "4096",
            "--global-batch-size", "512", "--micro-batch-sizes", "1", "--sequence-parallel", "off",
            "--zero-stages", "1", "--json", "--top", "1000"]
    assert plan_parallelism.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert {r["ep"] for r in rows} == {1, 2, 4, 8}, sorted({r["ep"] for r in rows})
    assert all(r["tp"] * r["pp"] * r["dp"] == 64 and r["dp"] % r["ep"] == 0 for r in rows)
    assert plan_parallelism.main(argv + ["--ep-sizes", "2"]) == 0
    assert {r["ep"] for r in json.loads(capsys.readouterr().out)["layouts"]} == {2}
    assert plan_parallelism.main(argv[:-3] + ["--ep-sizes", "4", "--top", "3"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split()[4] == "EP" and all(line.split()[4] == "4" for line in table[3:]), table
    with pytest.raises(SystemExit, match="has no experts"):
        plan_parallelism.main(["--model", "7B1", "--num-gpus", "8", "--global-batch-size", "8", "--ep-sizes", "2"])


def test_pipeline_schedules_are_searched_when_asked(capsys):
    """--schedules: each layout with PP > 1 also under ZB-H1 and interleaved v = 2 where they run; the table names
    the schedule; the default stays 1F1B only."""
    argv = ["--model", "llama-3-70b", "--num-gpus", "64", "--gpu", "H100-80GB", "--seq-length", "4096",
            "--global-batch-size", "512", "--micro-batch-sizes", "1", "--sequence-parallel", "off",
            "--zero-stages", "1", "--json", "--top", "1000"]
    assert plan_parallelism.main(argv) == 0
    assert {r["schedule"] for r in json.loads(capsys.readouterr().out)["layouts"]} == {"1f1b"}
    assert plan_parallelism.main(argv + ["--schedules", "1f1b", "zbh1", "interleaved"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert {r["schedule"] for r in rows} == {"1f1b", "zbh1", "interleaved"}
    assert all(r["pp"] > 1 for r in rows if r["schedule"] != "1f1b")
    assert {r["virtual_stages"] for r in rows if r["schedule"] == "interleaved"} == {2}
    assert plan_parallelism.main(argv[:-3] + ["--schedules", "zbh1", "--top", "3"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split()[-1] == "schedule" and all(line.split()[-1] == "ZB-H1" for line in table[3:]), table


def test_fp8_layouts_are_the_librarys_and_refused_on_an_a100(capsys):
    """--fp8-format plans the FP8 model shape (megatron.planner.fp8): the rows are the library's step times for it;
    an A100 (no FP8 tensor cores) is refused with the cause and the fix."""
    import dataclasses

    from megatron.config.fp8 import FP8Config
    from megatron.planner import CLUSTERS, GPUS, LLAMA_SIZES, plan_layouts
    from megatron.planner.fp8 import fp8_shape_of

    argv = ["--model", "llama-3-8b", "--num-gpus", "8", "--gpu", "H100-80GB", "--seq-length", "4096",
            "--global-batch-size", "64", "--recompute", "yes", "--zero-stages", "1", "--sequence-parallel", "off",
            "--top", "3", "--json"]
    assert plan_parallelism.main(argv + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    shape = dataclasses.replace(LLAMA_SIZES["llama-3-8b"], fp8=fp8_shape_of(
        FP8Config(fp8_format="hybrid", fp8_recipe="tensorwise"), 32))
    expected = plan_layouts(shape, GPUS["H100-80GB"], CLUSTERS["dgx-h100"], 8, 4096, 64, recompute=(True,),
                            zero_stages=(1,), sequence_parallel=(False,))[:3]
    assert [r["step_s"] for r in rows] == [p.row()["step_s"] for p in expected]
    assert plan_parallelism.main(argv) == 0
    bf16 = json.loads(capsys.readouterr().out)["layouts"]
    assert [r["step_s"] for r in rows] != [r["step_s"] for r in bf16]
    with pytest.raises(SystemExit, match="the A100-80GB \\(--gpu\\) has capability 8.0, without FP8 tensor cores; "
                                         "drop --fp8-format"):
        plan_parallelism.main(argv[:5] + ["A100-80GB"] + argv[6:] + ["--fp8-format", "e4m3"])
