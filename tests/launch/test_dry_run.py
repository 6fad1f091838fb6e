"""``pretrain_gpt.py --dry-run`` on BigScience's own tr11 commands (tests/helpers/tr11_jobs.py): each is
accepted at the world size its script launches, and the plan it prints (as JSON) has the layout, the
stages, the batch rampup, the run length, the schedule and the memory per GPU; a broken command lists
all of its problems at once and exits 1."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron.data.tokenizers import train_bpe_tokenizer
from megatron.dry_run import build_report, dry_run
from megatron.dry_run.text import render
from megatron.planner import ModelShape
from megatron.planner.candidate import layers_per_stage
from megatron.testing.tiny_corpus import make_text
from megatron.testing.tolerance import tolerance
from tests.helpers.data import fill_hub_cache
from tests.helpers.paths import REPO_ROOT
from tests.helpers.tr11_jobs import JOBS, TOKENIZER_NAME_OR_PATH, write_job_files

# name: (TP, PP, DP, transformer layers per stage) that DeepSpeed's 'type:transformer|embedding' gives
EXPECTED = {
    "176B-48nodes": (4, 12, 8, [5] + [6] * 10 + [5]),
    "176B-24nodes": (4, 12, 4, [5] + [6] * 10 + [5]),
    "1B3": (2, 2, 16, [12, 12]),
    "760M": (1, 2, 16, [12, 12]),
    "350M": (1, 1, 32, [24]),
}


@pytest.fixture(scope="module")
def tr11_files(tmp_path_factory):
    """Stand-in files for every job, and the scripts' tokenizer hub name in a local Hugging Face cache (a
    tiny byte-level BPE stands in for BLOOM's 250k one: --pad-vocab-size-to 250880 pads either)."""
    d = tmp_path_factory.mktemp("tr11")
    tokenizer = train_bpe_tokenizer(make_text(100, seed=0), 500, str(d / "tokenizer"))
    cache = d / "hub"
    with open(tokenizer["tokenizer_json"], "rb") as f:
        fill_hub_cache(cache, TOKENIZER_NAME_OR_PATH, {"tokenizer.json": f.read()})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_CACHE", str(cache))
        yield {name: write_job_files(job, d / name) for name, job in JOBS.items()}


def _megatron_rampup(start, increment, ramp_samples, global_batch_size, train_samples):
    """Megatron's rampup written out (RampupBatchsizeNumMicroBatches + the loop's stop rule): (iteration
    of the first full batch, samples consumed before it, iterations of the run, samples consumed)."""
    per_increment = ramp_samples / ((global_batch_size - start) // increment)
    consumed, iteration, full_from = 0, 0, None
    while consumed < train_samples:
        size = global_batch_size if consumed > ramp_samples else start + int(consumed / per_increment) * increment
        if size == global_batch_size and full_from is None:
            full_from = (iteration + 1, consumed)
        consumed += size
        iteration += 1
    return full_from + (iteration, consumed)


@pytest.mark.parametrize("name", sorted(JOBS))
def test_tr11_job_dry_run_plan(name, tr11_files, tmp_path):
    job, out = JOBS[name], tmp_path / "plan.json"
    argv = job.argv(tr11_files[name]) + ["--dry-run", "--world-size", str(job.world_size), "--dry-run-json", str(out)]
    assert dry_run(argv, out=io.StringIO()) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["problems"] == [] and report["world_size"]["value"] == job.world_size
    tp, pp, dp, layers = EXPECTED[name]
    v = job.values
    lay = report["layout"]
    assert (lay["tensor_model_parallel_size"], lay["pipeline_model_parallel_size"], lay["data_parallel_size"]) == \
        (tp, pp, dp) == (v["TP_SIZE"], v["PP_SIZE"], job.world_size // (v["TP_SIZE"] * v["PP_SIZE"]))
    stages = lay["stages"]
    assert [s["num_transformer_layers"] for s in stages] == layers
    # the planner's documented reading of the same rule agrees with DeepSpeed's own partition
    shape = ModelShape(v["NLAYERS"], v["NHIDDEN"], v["NHEADS"], 250880)
    assert layers_per_stage(shape, pp, "type:transformer|embedding") == layers
    assert "embedding" in stages[0]["holds"] and {"final_layernorm", "head"} <= set(stages[-1]["holds"])
    assert [s["ranks"] for s in stages] == [[i * tp * dp, (i + 1) * tp * dp - 1] for i in range(pp)]
    assert stages[0]["transformer_layers"][0] == 0 and stages[-1]["transformer_layers"][1] == v["NLAYERS"] - 1
    assert report["model"]["padded_vocab_size"] == 250880

    mbs, gbs = v["MICRO_BATCH_SIZE"], v["GLOBAL_BATCH_SIZE"]
    start, increment, ramp_samples = (int(x) for x in v["RAMPUP_BATCH_SIZE"].split())
    b, r = report["batch"], report["batch"]["rampup"]
    assert (b["micro_batch_size"], b["global_batch_size"], b["num_micro_batches"]) == (mbs, gbs, gbs // (mbs * dp))
    assert (r["start"], r["increment"], r["rampup_samples"]) == (start, increment, ramp_samples)
    assert r["num_increments"] == (gbs - start) // increment and r["start_num_micro_batches"] == start // (mbs * dp)
    full_iteration, full_consumed, iterations, consumed = _megatron_rampup(start, increment, ramp_samples, gbs,
                                                                           220_000_000)
    assert (r["full_batch_iteration"], r["full_batch_consumed_samples"]) == (full_iteration, full_consumed)
    run = report["run"]
    assert (run["iterations"], run["consumed_samples"], run["tokens"]) == (iterations, consumed, consumed * 2048)
    assert 220_000_000 <= consumed < 220_000_000 + gbs

    points = {p["point"]: p for p in report["lr_schedule"]["points"]}
    assert points["warmup end"]["samples"] == 183_105 and points["decay end"]["samples"] == 200_000_000
    # The scheduler's Python floats: at the warmup's end max_lr * w / w, two roundings of max_lr; from the decay's
    # end on exactly min_lr (min_lr + 0.5 * (cos(pi) + 1) * (max_lr - min_lr), with cos(pi) == -1.0, or min_lr).
    lr = float(v["LR"])
    assert abs(points["warmup end"]["lr"] - lr) <= tolerance(torch.float64, 2, 1, lr), points["warmup end"]
    assert points["decay end"]["lr"] == points["end of training"]["lr"] == float(v["MIN_LR"])

    memory = report["memory"]
    assert memory["gpu"] == "A100-80GB" and len(memory["per_stage_gib"]) == pp and memory["peak_gib"] > 1
    assert report["step"]["step_s"] > 0


@pytest.mark.parametrize("name", ["176B-48nodes", "176B-24nodes"])
def test_bloom_176b_fits_the_gpus_it_trained_on(name, tr11_files):
    """BLOOM-176B trained on A100-80GB with both layouts: the estimate must say it fits, with the bf16 +
    ZeRO-0 of its script run as DeepSpeed 0.19's BF16_Optimizer (stage 1)."""
    job = JOBS[name]
    report = build_report(job.argv(tr11_files[name]) + ["--dry-run", "--world-size", str(job.world_size)])
    assert report["ok"] and report["memory"]["fits"], report["memory"]
    assert (report["model"]["zero_stage"], report["model"]["deepspeed_zero_stage"]) == (0, 1)
    assert report["model"]["params_dtype"] == "bf16"


def test_cli_takes_the_world_size_from_slurm_as_bloom_launches(tr11_files, tmp_path):
    """The real command line, in a SLURM allocation of 48 nodes with one task per node and 8 GPUs each
    (BLOOM's sbatch header), without --world-size: 48 x 8 = 384."""
    job, out = JOBS["176B-48nodes"], tmp_path / "plan.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in ("WORLD_SIZE", "RANK")}
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="48", SLURM_NNODES="48", SLURM_NTASKS="48",
               SLURM_NTASKS_PER_NODE="1", SLURM_GPUS_ON_NODE="8", HF_HUB_CACHE=os.environ["HF_HUB_CACHE"])
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *job.argv(tr11_files[job.name]),
                           "--dry-run", "--dry-run-json", str(out)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout.strip()
    report = json.loads(out.read_text())
    assert report["world_size"] == {"value": 384, "source": "SLURM_JOB_NUM_NODES=48 x SLURM_GPUS_ON_NODE=8 (one "
                                                              "torchrun per node, as BLOOM's scripts)"}
    assert report["layout"]["data_parallel_size"] == 8


def test_a_broken_command_lists_every_problem_and_exits_1(tr11_files, tmp_path):
    job, out = JOBS["350M"], tmp_path / "plan.json"
    paths = write_job_files(job, tmp_path)
    os.remove(tmp_path / "data" / "roots_fr_text_document.idx")
    argv = job.argv(paths) + ["--dry-run", "--world-size", "32", "--dry-run-json", str(out), "--no-such-flag"]
    broken = {"--num-attention-heads": "15", "--min-lr": "1e-3", "--global-batch-size": "250",  # the JSON says 256
              "--tokenizer-name-or-path": "no-org/no-such-tokenizer"}
    for flag, value in broken.items():
        argv[argv.index(flag) + 1] = value
    assert dry_run(argv, out=io.StringIO()) == 1
    report = json.loads(out.read_text())
    problems = report["problems"]
    expected = ["unrecognized arguments: --no-such-flag", "roots_fr_text_document.idx", "no-org/no-such-tokenizer",
                "--num-attention-heads 15", "--min-lr 0.001", "--global-batch-size 250 is not a multiple",
                "DeepSpeed config key train_batch_size = 256"]
    for text in expected:
        assert sum(text in p for p in problems) == 1, (text, problems)
    assert len(problems) == len(expected) and all("\n" not in p for p in problems)
    assert not report["ok"] and report["layout"] is None and report["memory"] is None
    assert report["not_checked"], "what could not be checked is said"


def test_on_a_laptop_without_data_or_tokenizer_the_plan_is_still_made(tr11_files, tmp_path, monkeypatch):
    """The cluster's split files and tokenizer are not on the laptop: they are the problems (exit 1), and the
    stages, rampup, schedule and memory (from --pad-vocab-size-to) are reported all the same."""
    job, out = JOBS["176B-48nodes"], tmp_path / "plan.json"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    paths = dict(tr11_files[job.name], TRAIN_DATA_PATH="/cluster/data/train-splits.txt",
                 VALID_DATA_PATH="/cluster/data/valid-splits.txt")
    assert dry_run(job.argv(paths) + ["--dry-run", "--world-size", "384", "--dry-run-json", str(out)],
                   out=io.StringIO()) == 1
    report = json.loads(out.read_text())
    assert [p.split(" ")[0] for p in report["problems"]] == ["--train-weighted-split-paths-path",
                                                             "--valid-weighted-split-paths-path",
                                                             "--tokenizer-name-or-path"]
    assert [s["num_transformer_layers"] for s in report["layout"]["stages"]] == EXPECTED[job.name][3]
    assert report["batch"]["rampup"]["num_increments"] == 116 and report["memory"]["fits"]
    assert report["model"]["padded_vocab_size"] is None
    assert any("--pad-vocab-size-to 250880" in w for w in report["warnings"])
    assert len(report["not_checked"]) == 3  # the two splits' data files, the tokenizer


def test_bloom_176b_with_context_parallelism_lays_out_the_ranks_and_estimates_the_ring(tr11_files):
    """BLOOM-176B's 48-node layout with --context-parallel-size 2 on twice the GPUs: the stages span the CP ranks,
    the memory is the planner's for s/2 tokens per rank, and the ring section gives the K / V bytes of a step."""
    job = JOBS["176B-48nodes"]
    argv = job.argv(tr11_files["176B-48nodes"]) + ["--dry-run", "--world-size", str(2 * job.world_size)]
    plain = build_report(job.argv(tr11_files["176B-48nodes"]) + ["--dry-run", "--world-size", str(job.world_size)])
    report = build_report(argv + ["--context-parallel-size", "2", "--attention-dropout", "0"])
    assert report["ok"], report["problems"]
    layout = report["layout"]
    assert (layout["context_parallel_size"], layout["data_parallel_size"], layout["world_size"]) == (2, 8, 768)
    assert layout["stages"][0]["ranks"] == [0, 63]  # TP 4 x DP 8 x CP 2 a stage
    assert not any("context-parallel" in line for line in report["not_checked"]), report["not_checked"]
    # against the same job on 384 GPUs (DP 8, CP 1): half the tokens per rank, the optimizer state sharded over
    # dp x cp = 16 ranks instead of 8
    cp_stage, dp_stage = report["memory"]["per_stage_gib"][0], plain["memory"]["per_stage_gib"][0]
    assert cp_stage["activations"] < 0.6 * dp_stage["activations"], (cp_stage, dp_stage)
    # per_stage_gib is rounded to 2 decimals: half of one rounded value against the other, 0.0025 + 0.005 apart
    assert abs(cp_stage["adam"] - dp_stage["adam"] / 2) <= 0.0075 and cp_stage["weights"] == dp_stage["weights"]
    ring = report["context_parallel"]
    assert (ring["context_parallel_size"], ring["tokens_per_rank"]) == (2, 1024)
    # by hand: one K block = b 2 x 112/4 heads x 1024 tokens x 128 = 7,340,032 elements; per layer and micro-batch
    # forward K + V 2 x block x 2 bytes, backward that + 2 x (dK + dV) in fp32, recomputed forward again: 28 blocks
    block, layers, micro_batches = 2 * 14336 // 4 * 1024, layout["stages"][0]["num_transformer_layers"], 2048 // 16
    # the report rounds these to 4 decimals: within half their last place
    assert abs(ring["per_layer_mib"]["total"] - 28 * block / 2 ** 20) <= 0.5e-4
    assert ring["stages"][0]["sends"] == 10 * layers * micro_batches  # (1 + 1 + 1) K/V hops x 2 + 2 dK/dV hops x 2
    assert abs(ring["stages"][0]["p2p_gib"] - 28 * block * layers * micro_batches / 2 ** 30) <= 0.5e-4
    assert "ring         CP 2: 1,024 tokens per rank" in render(report)
