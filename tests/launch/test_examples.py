"""The launch scripts in examples/: they parse (bash -n), every flag set they generate is accepted by
``megatron.arguments.run_config_from_argv`` at the world size the script launches (so the scripts cannot
drift from the parser), the DeepSpeed JSON they write agrees with their flags, and the tiny ones train."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron.config.deepspeed import build_deepspeed_config
from megatron.testing.tiny_corpus import write_stand_in_dataset
from tests.helpers.examples import EXAMPLES, sbatch_option, script_argv, stand_in_run_config

SCRIPTS = sorted([*EXAMPLES.glob("*.sh"), *EXAMPLES.glob("slurm/*.sh"), *EXAMPLES.glob("slurm/*.slurm")])
BLOOM_SCRIPTS = sorted(EXAMPLES.glob("slurm/bloom-*.slurm"))

# name: (layers, hidden, heads, TP, PP, nodes, GPUs per node, micro-batch, global batch, lr) as in the scripts
BLOOM = {
    "176b": (70, 14336, 112, 4, 12, 48, 8, 2, 2048, 6e-5),
    "6b3": (30, 4096, 32, 4, 4, 32, 4, 1, 512, 1.2e-4),
    "2b5": (30, 2560, 32, 4, 4, 32, 4, 1, 512, 1.6e-4),
    "1b3": (24, 2048, 16, 1, 2, 16, 4, 2, 512, 2e-4),
    "760m": (24, 1536, 16, 1, 2, 8, 4, 1, 256, 2.5e-4),
    "350m": (24, 1024, 16, 1, 1, 8, 4, 1, 256, 3e-4),
}


def test_scripts_are_found_and_every_one_passes_bash_n():
    names = {p.name for p in SCRIPTS}
    assert {"train_tiny_torchrun.sh", "deepspeed_launcher.sh", "tiny_bloom.slurm", "launch_lib.sh",
            "bloom-176b.slurm"} <= names, names
    assert {p.stem.replace("bloom-", "") for p in BLOOM_SCRIPTS} == set(BLOOM)
    for path in SCRIPTS:
        proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{path}: {proc.stderr}"


@pytest.fixture(scope="module")
def fake_data(tmp_path_factory):
    """Data and tokenizer paths that exist (their existence is checked, nothing is read)."""
    d = tmp_path_factory.mktemp("fake_data")
    prefix = d / "corpus_text_document"
    write_stand_in_dataset(prefix)
    (d / "train-splits.txt").write_text(f'"train: 1 0:0.95 {prefix}"\n')
    (d / "valid-splits.txt").write_text(f'"valid: 1 0.95:1 {prefix}"\n')
    (d / "bloom-tokenizer").mkdir()
    for name in ("vocab.json", "merges.txt"):
        (d / name).write_text("")
    return {"DATA_DIR": str(d), "DATA_PREFIX": str(prefix), "VOCAB_FILE": str(d / "vocab.json"),
            "MERGE_FILE": str(d / "merges.txt")}


@pytest.mark.parametrize("name", sorted(BLOOM))
def test_bloom_script_flags_parse_at_its_world_size(name, fake_data, tmp_path):
    script = EXAMPLES / "slurm" / f"bloom-{name}.slurm"
    world_size, argv = script_argv(script, tmp_path, {"DATA_DIR": fake_data["DATA_DIR"]})
    layers, hidden, heads, tp, pp, nodes, gpus, mbs, gbs, lr = BLOOM[name]
    assert int(sbatch_option(script, "nodes")) == nodes
    assert sbatch_option(script, "gres") == f"gpu:{gpus}"
    assert world_size == nodes * gpus

    rc = stand_in_run_config(argv, world_size)
    m, p, o, s = rc.model, rc.parallel, rc.optimizer, rc.lr_schedule
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (layers, hidden, heads, 2048)
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (tp, pp)
    assert p.data_parallel_size == world_size // (tp * pp) and rc.world_size == world_size
    assert (rc.batch.micro_batch_size, rc.batch.global_batch_size, o.lr) == (mbs, gbs, lr)
    assert rc.training.train_samples == 220_000_000 and s.lr_decay_samples == 200_000_000
    assert s.lr_warmup_samples == 183_105 and s.lr_decay_style == "cosine"
    assert (o.adam_beta1, o.adam_beta2, o.adam_eps, o.weight_decay, o.clip_grad) == (0.9, 0.95, 1e-8, 0.1, 1.0)
    assert m.position_embedding_type == "alibi" and m.embed_layernorm and rc.data.pad_vocab_size_to == 250880
    assert m.init_method_std == 0.0048 and m.seed == 42 and rc.training.seed == 42
    assert p.pp_partition_method == "type:transformer|embedding"
    assert rc.data.tokenizer.tokenizer_type == "PretrainedFromHF" and p.distributed_backend == "nccl"
    assert rc.data.train_weighted_split_groups and rc.data.valid_weighted_split_groups
    assert rc.checkpoint.save == rc.checkpoint.load and rc.exit.kill_switch_path and rc.logging.tensorboard_dir
    assert rc.exit.exit_duration_in_mins > 0
    # the JSON the job writes agrees with the flags (run_config_from_argv checked it) and selects BLOOM's optimizer
    ds = rc.deepspeed_user_config
    assert (ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"], ds["gradient_clipping"]) == (mbs, gbs, 1.0)
    assert ds["zero_optimization"]["stage"] == rc.precision.zero_stage == 0  # BigScience's stage
    if rc.bf16:  # BF16_Optimizer, which DeepSpeed 0.19 calls stage 1
        assert ds["bf16"]["enabled"] and ds["data_types"]["grad_accum_dtype"] == "fp32" and rc.deepspeed_zero_stage == 1
        assert build_deepspeed_config(rc, ds)["zero_optimization"]["stage"] == 1
        assert sum("--zero-stage 0 with --bf16 runs DeepSpeed's BF16_Optimizer" in w for w in rc.startup_warnings) == 1
    else:
        assert rc.fp16 and ds["fp16"]["enabled"] and rc.deepspeed_zero_stage == 0


def test_bloom_176b_is_bigscience_configuration(fake_data, tmp_path):
    world_size, argv = script_argv(EXAMPLES / "slurm" / "bloom-176b.slurm", tmp_path,
                                   {"DATA_DIR": fake_data["DATA_DIR"]})
    rc = stand_in_run_config(argv, world_size)
    t, lg = rc.training, rc.logging
    assert (world_size, rc.parallel.data_parallel_size) == (384, 8)
    assert rc.batch.rampup_batch_size == (192, 16, 9_765_625)
    assert (rc.optimizer.min_lr, rc.bf16, t.checkpoint_activations, t.sync_tp_duplicated_parameters) == \
        (6e-6, True, True, True)
    assert any("--abort-on-unmet-fused-kernel-constraints" in w for w in rc.startup_warnings)
    assert rc.data.data_impl == "mmap"
    assert (lg.log_interval, t.eval_interval, t.eval_iters, rc.checkpoint.save_interval) == (1, 1000, 1, 100)
    assert lg.log_timers_to_tensorboard and lg.log_batch_size_to_tensorboard and lg.log_validation_ppl_to_tensorboard
    # the experiment's folders are per experiment and variant
    assert rc.checkpoint.save.endswith("bloom-176b/checkpoints/main")
    assert lg.tensorboard_dir.endswith("bloom-176b/tensorboard/main")


@pytest.mark.parametrize("script, style", [("slurm/tiny_bloom.slurm", "torchrun"), ("slurm/tiny_bloom.slurm", "srun"),
                                           ("deepspeed_launcher.sh", None)])
def test_tiny_launch_flags_parse(script, style, fake_data, tmp_path):
    extra = {k: v for k, v in fake_data.items() if k != "DATA_DIR"}
    if style:
        extra["LAUNCH_STYLE"] = style
    world_size, argv = script_argv(EXAMPLES / script, tmp_path, extra)
    rc = stand_in_run_config(argv, world_size)
    assert world_size == 2 and rc.parallel.data_parallel_size == 1
    assert rc.deepspeed_user_config["train_batch_size"] == rc.batch.global_batch_size


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tiny_torchrun_then_deepspeed_launcher_resumes_it(tmp_path):
    """train_tiny_torchrun.sh trains and saves; deepspeed_launcher.sh (hostfile, DeepSpeed's launcher)
    continues the same run from that checkpoint."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron.testing.tiny_corpus import make_tiny_corpus

    corpus = make_tiny_corpus(str(tmp_path / "corpus"))
    run_dir = tmp_path / "run"
    env = dict(os.environ, PY=sys.executable, RUN_DIR=str(run_dir), TRAIN_ITERS="8", NPROC="2",
               DATA_PREFIX=corpus["data_prefix"], VOCAB_FILE=corpus["vocab_file"], MERGE_FILE=corpus["merge_file"],
               DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    for script, extra in (("train_tiny_torchrun.sh", ["--exit-interval", "4"]), ("deepspeed_launcher.sh", [])):
        # tensorboard gets a point per --log-interval. A port of its own per launch: one picked once and kept for the
        # second launch can be taken in between as the source port of another worker's connection.
        env["MASTER_PORT"] = str(_free_port())
        proc = subprocess.run(["bash", str(EXAMPLES / script), *extra, "--log-interval", "1"], env=env,
                              capture_output=True, text=True, timeout=300)
        errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "Error" in line][:20]
        assert proc.returncode == 0, (f"{script} exited {proc.returncode}; its error lines:\n" + "\n".join(errors)
                                      + f"\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        latest = (run_dir / "checkpoints" / "latest").read_text().strip()
        assert latest == ("global_step4" if extra else "global_step8")
        assert (run_dir / "checkpoints" / latest / "complete").is_file()
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    steps = [e.step for e in acc.Scalars("lm-loss-training/lm loss")]
    assert steps == list(range(1, 9)), steps  # the second launcher started at 5


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("precision", ["auto", "bf16", "fp32", "fp16"])
def test_cpu_scripts_choose_the_precision_the_hardware_runs_fast(precision):
    """examples/precision.sh: auto is bf16 where bf16 runs on hardware, fp32 elsewhere (the same choice as
    megatron.config.hardware.default_precision); bf16 and fp32 are taken as given; anything else exits 2."""
    from megatron.config.hardware import default_precision

    proc = subprocess.run(["bash", "-c", f'source examples/precision.sh; choose_precision "{sys.executable}"; '
                                         'echo "flags:${PRECISION_FLAGS[*]+${PRECISION_FLAGS[*]}}"'],
                          cwd=EXAMPLES.parent, env=dict(os.environ, PRECISION=precision), capture_output=True,
                          text=True, timeout=120)
    if precision == "fp16":
        assert proc.returncode == 2 and "PRECISION=fp16: use auto, bf16 or fp32" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    chosen = default_precision()[0] if precision == "auto" else precision
    assert proc.stdout.splitlines()[-1] == ("flags:--bf16" if chosen == "bf16" else "flags:")
    assert (f"precision: {chosen} (" in proc.stdout) == (precision == "auto")
