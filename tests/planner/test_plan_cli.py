"""tools/plan_parallelism.py: the table and --json agree with the library's ranking."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import plan_parallelism  # noqa: E402

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
