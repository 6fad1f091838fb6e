"""Leaving cleanly (exit interval, kill switch, SIGTERM to one rank) and the tensorboard and W&B records."""

import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from megatron.testing import run_distributed, tiny_argv
from megatron.training.log_writers import CUSTOM_AXES
from tests.helpers.faults import poisoned_env
from tests.helpers.paths import REPO_ROOT
from tests.helpers.training import tensorboard_scalars, train
from tests.helpers.wandb_offline import offline_runs, read_offline_run


def _latest(save_dir):
    with open(os.path.join(save_dir, "latest")) as f:
        return f.read().strip()


@pytest.mark.multiprocess
def test_exit_interval_and_kill_switch_save_and_tensorboard_holds_the_run(tiny_corpus, tmp_path):
    tb, save_a, save_b = tmp_path / "tb", tmp_path / "ckpt_a", tmp_path / "ckpt_b"
    kill_switch = tmp_path / "kill-switch"
    kill_switch.write_text("stop")
    # W&B offline (no network needed), into --save's wandb/ folder (Megatron's default), beside tensorboard
    logged = tiny_argv(tiny_corpus, train_iters=20, eval_interval=3, eval_iters=1, exit_interval=6,
                       save=str(save_a), save_interval=100, tensorboard_dir=str(tb),
                       log_timers_to_tensorboard=True, log_batch_size_to_tensorboard=True,
                       log_validation_ppl_to_tensorboard=True, loss_spike_factor=0.5,
                       wandb_project="tiny", wandb_exp_name="exit-interval", log_throughput=True, peak_tflops=0.5)
    killed = tiny_argv(tiny_corpus, train_iters=20, save=str(save_b), save_interval=100,
                       kill_switch_path=str(kill_switch))
    (interval_run, kill_run), = run_distributed(train, world_size=1, args=([logged, killed],),
                                                env={"WANDB_MODE": "offline"})

    # --exit-interval 6: stops after iteration 6 with a checkpoint; the kill switch after the first.
    assert (interval_run["reason"], interval_run["iteration"]) == ("exit-interval", 6)
    assert _latest(save_a) == "global_step6" and (save_a / "global_step6" / "complete").is_file()
    assert (kill_run["reason"], kill_run["iteration"]) == ("kill-switch", 1)
    assert _latest(save_b) == "global_step1"

    scalars = tensorboard_scalars(tb)
    history = interval_run["history"]
    loss = scalars["lm-loss-training/lm loss"]
    assert [step for step, _ in loss] == [1, 2, 3, 4, 5, 6]
    for (step, value), (iteration, expected, _, _, _) in zip(loss, history):
        assert step == iteration and value == pytest.approx(expected, rel=1e-6)
    assert [s for s, _ in scalars["lm-loss-training/lm loss vs samples"]] == [8 * i for i in range(1, 7)]
    assert [s for s, _ in scalars["lm-loss-training/lm loss vs tokens"]] == [8 * 32 * i for i in range(1, 7)]
    assert [v for _, v in scalars["learning-rate/learning-rate"]] == pytest.approx([h[3] for h in history])
    assert [v for _, v in scalars["grad-norm/grad-norm"]] == pytest.approx([h[2] for h in history])
    assert [v for _, v in scalars["batch-size/batch-size"]] == [8.0] * 6
    assert "iteration-time/iteration-time" in scalars
    validation = scalars["lm-loss-validation/lm loss validation"]
    assert [s for s, _ in validation] == [3, 6]
    ppl = scalars["lm-loss-validation/lm loss validation ppl"]
    assert [v for _, v in ppl] == pytest.approx([math.exp(v) for _, v in validation], rel=1e-5)
    # --loss-spike-factor 0.5: once 5 losses are known, every loss is "above 0.5 x their mean": reported
    losses = [h[1] for h in history]
    assert scalars["loss-spikes/loss-spike-ratio"] == [(6, pytest.approx(losses[5] / (sum(losses[:5]) / 5)))]
    assert scalars["loss-spikes/loss-spikes"] == [(6, 1.0)]
    _assert_wandb_holds(save_a / "wandb", scalars, history)


def _assert_wandb_holds(wandb_dir, scalars, history):
    """The W&B offline run holds what tensorboard holds (every tag, step and value), the run's losses exactly,
    and --log-throughput's values from Megatron's FLOPs formula on the logged iteration time."""
    files = offline_runs(wandb_dir)
    assert len(files) == 1, files
    run = read_offline_run(files[0])
    assert (run.project, run.name) == ("tiny", "exit-interval")
    assert (run.config["num_layers"], run.config["train_iters"], run.config["wandb_project"]) == (2, 20, "tiny")
    axes = {"Samples": dict(run.history["Samples"]), "Tokens": dict(run.history["Tokens"])}
    assert set(run.history) - {"_step", "_runtime", "_timestamp", *axes} == set(scalars)
    for tag, points in scalars.items():
        axis = next((axes[name] for suffix, name in CUSTOM_AXES if tag.endswith(suffix)), None)
        logged = [(step if axis is None else axis[step], value) for step, value in run.history[tag]]
        # tensorboard keeps float32 of the value W&B keeps in full
        assert [(step, float(np.float32(value))) for step, value in logged] == points, tag
    losses = [(h[0], h[1]) for h in history]
    assert run.history["lm-loss-training/lm loss"] == losses  # exactly: JSON keeps every bit of a float64
    assert run.summary["lm-loss-training/lm loss"] == losses[-1][1]

    # --log-throughput, per GPU (one here): Megatron's model FLOPs (no recomputation) of the tiny model,
    # 24 c B s L h^2 (1 + s / (6h) + V / (16 L h)) with c = 3, B = 8, s = 32, L = 2, h = 64, V = 512 rows
    assert run.config["padded_vocab_size"] == 512
    flops = 24 * 3 * 8 * 32 * 2 * 64 ** 2 * (1 + 32 / (6 * 64) + 512 / (16 * 2 * 64))
    seconds = dict(run.history["iteration-time/iteration-time"])
    assert sorted(seconds) == [1, 2, 3, 4, 5, 6]
    for tag, expected in (("throughput", lambda t: flops / t / 1e12),
                          ("throughput/tokens per second per GPU", lambda t: 8 * 32 / t),
                          ("throughput/MFU", lambda t: flops / t / 1e12 / 0.5)):  # --peak-tflops 0.5
        assert [step for step, _ in run.history[tag]] == sorted(seconds), tag
        for step, value in run.history[tag]:  # the same float64 arithmetic, in another order: a few ulps
            assert value == pytest.approx(expected(seconds[step]), rel=1e-12), (tag, step)


@pytest.mark.multiprocess
def test_sigterm_to_one_rank_stops_all_ranks_with_a_checkpoint(tiny_corpus, tmp_path):
    import psutil

    save = tmp_path / "ckpt"
    argv = tiny_argv(tiny_corpus, train_iters=100000, save=str(save), save_interval=100000,
                     pipeline_model_parallel_size=2)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO_ROOT / "pretrain_gpt.py"), *argv]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        for line in proc.stdout:
            if " iteration        3/" in line:
                break
            assert time.time() < deadline, "training did not reach iteration 3"
        workers = psutil.Process(proc.pid).children()
        assert len(workers) == 2, workers
        os.kill(workers[-1].pid, signal.SIGTERM)  # only one rank receives the signal, as under a ragged preemption
        rest = proc.communicate(timeout=240)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest[-3000:]
    tag = _latest(save)
    assert (save / tag / "complete").is_file()
    stopped_at = int(tag.replace("global_step", ""))
    assert stopped_at >= 3
    # Both pipeline stages saved their layers at the same iteration.
    layer_files = [f for f in os.listdir(save / tag) if f.startswith("layer_")]
    assert len(layer_files) >= 4, layer_files


@pytest.mark.multiprocess
def test_weighted_split_groups_are_evaluated_and_logged_by_name(tiny_corpus, tmp_path):
    prefix = tiny_corpus["data_prefix"]
    groups = tmp_path / "valid-splits.txt"
    groups.write_text(f'"valid_a: 1 0.9:0.95 {prefix}" "valid_b: 0.5 0.95:1 {prefix}, 0.5 0.9:0.95 {prefix}"\n')
    tb = tmp_path / "tb"
    argv = tiny_argv(tiny_corpus, "--train-weighted-split-paths", f"train: 1 0:0.9 {prefix}",
                     "--valid-weighted-split-paths-path", str(groups), data_path=None, split=None,
                     train_iters=4, eval_interval=2, eval_iters=1, tensorboard_dir=str(tb),
                     log_interval=3, tensorboard_log_interval=2)
    (run,), = run_distributed(train, world_size=1, args=([argv],))
    scalars = tensorboard_scalars(tb)
    # Training scalars follow --tensorboard-log-interval, each iteration's own loss (not the log average).
    assert scalars["lm-loss-training/lm loss"] == [(2, pytest.approx(run["history"][1][1])),
                                                  (4, pytest.approx(run["history"][3][1]))]
    for name in ("valid_a", "valid_b"):
        steps = [s for s, _ in scalars[f"lm-loss-validation/{name}/lm loss validation"]]
        assert steps == [2, 4], (name, sorted(scalars))
    a = scalars["lm-loss-validation/valid_a/lm loss validation"]
    b = scalars["lm-loss-validation/valid_b/lm loss validation"]
    assert a != b  # different documents, different losses


@pytest.mark.multiprocess
def test_a_diverged_run_stops_at_its_first_nonfinite_iteration_without_saving_it(tiny_corpus, tmp_path):
    # --check-for-nan-in-loss-and-grad is on by default: no flag asks for it. Iteration 3's gradient is made NaN
    # on purpose (tests/helpers/faults.py): when a huge learning rate would first give one depends on the CPU.
    save = tmp_path / "ckpt"
    argv = tiny_argv(tiny_corpus, train_iters=6, save=str(save), save_interval=1)
    env = dict(poisoned_env(tmp_path / "faults", {3}, "nan"), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("error: iteration 3: non-finite loss or gradient norm"), \
        proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # every iteration before the bad one was saved (--save-interval 1); the bad state was not
    assert _latest(save) == "global_step2" and not (save / "global_step3").exists()
