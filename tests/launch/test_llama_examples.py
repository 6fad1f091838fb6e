"""The Llama examples: examples/slurm/llama2-7b.slurm's flags are a Llama-2-7B (6.74B parameters) that
``--dry-run`` plans on 32 H100s, and examples/pretrain_tiny_llama_cpu.sh trains on 8 CPU processes and
exports to transformers' LlamaForCausalLM."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from megatron.config.hardware import default_precision
from megatron.dry_run import dry_run
from megatron.planner import model_shape_of
from tests.helpers.examples import (
    EXAMPLES,
    dry_run_report,
    sbatch_option,
    script_argv,
    sentencepiece_stand_ins,
    stand_in_run_config,
    train_cpu_example,
)

SCRIPT = EXAMPLES / "slurm" / "llama2-7b.slurm"


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory):
    """A stand-in dataset and a small SentencePiece model in place of Meta's tokenizer.model (the script pads
    the vocabulary to Meta's 32,000 rows either way)."""
    return sentencepiece_stand_ins(tmp_path_factory.mktemp("llama"), "llama_text_document")


def test_llama2_7b_script_is_llama_2_7b(llama_files, tmp_path):
    world_size, argv = script_argv(SCRIPT, tmp_path, llama_files)
    assert world_size == int(sbatch_option(SCRIPT, "nodes")) * 8 == 32
    rc = stand_in_run_config(argv, world_size)
    m, p = rc.model, rc.parallel
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.ffn_size, m.seq_length) == \
        (32, 4096, 32, 32, 11008, 4096)
    assert (m.normalization, m.swiglu, m.position_embedding_type, m.rotary_base, m.layernorm_epsilon) == \
        ("rmsnorm", True, "rotary", 10000.0, 1e-5)
    assert not m.add_bias_linear and not m.tied_embeddings and rc.data.pad_vocab_size_to == 32000
    assert model_shape_of(m, 32000).total_params() == 6_738_415_616
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size) == (2, 1, 16)
    assert rc.batch.global_batch_size * m.seq_length == 4 * 1024 ** 2  # Llama 2's 4M tokens per step
    assert rc.bf16 and rc.deepspeed_zero_stage == 1 and rc.training.checkpoint_activations
    ds = rc.deepspeed_user_config
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"]) == (1024, 2)
    # GQA variant: 8 key / value heads, still whole groups on each of the 2 TP ranks
    _, gqa = script_argv(SCRIPT, tmp_path, dict(llama_files, NUM_KV_HEADS="8"))
    assert stand_in_run_config(gqa, 32).model.num_kv_heads == 8


def test_llama2_7b_dry_run_plan(llama_files, tmp_path):
    world_size, argv = script_argv(SCRIPT, tmp_path, llama_files)
    status, report = dry_run_report(argv, world_size, tmp_path / "plan.json", "--dry-run-gpu", "H100-80GB")
    assert status == 0 and report["ok"] and report["problems"] == [], report["problems"]
    model = report["model"]
    assert (model["num_parameters"], model["padded_vocab_size"], model["ffn_hidden_size"]) == (6_738_415_616, 32000,
                                                                                               11008)
    assert (model["normalization"], model["swiglu"], model["tied_embeddings"]) == ("rmsnorm", True, False)
    stages = report["layout"]["stages"]
    assert len(stages) == 1 and {"embedding", "final_layernorm", "head"} <= set(stages[0]["holds"])
    assert report["memory"]["fits"] and report["memory"]["gpu"] == "H100-80GB"
    assert report["run"]["tokens"] >= 2 * 10 ** 12
    # an impossible variant is refused naming the fix, before anything starts
    _, bad = script_argv(SCRIPT, tmp_path, dict(llama_files, NUM_KV_HEADS="1"))
    status, report = dry_run_report(bad, 32, tmp_path / "bad.json")
    assert status == 1 and any("--num-key-value-heads 1 is not divisible by --tensor-model-parallel-size 2" in problem
                               for problem in report["problems"])


def test_llama2_7b_script_as_zero3_with_hpz(llama_files, tmp_path):
    """The sharded alternative: ZERO_STAGE=3 TP_SIZE=1 HPZ_SIZE=8 is ZeRO-3 over all 32 GPUs with a secondary
    parameter shard per node; with the pipeline it is refused before anything starts, naming both choices."""
    world_size, argv = script_argv(SCRIPT, tmp_path, dict(llama_files, ZERO_STAGE="3", TP_SIZE="1", HPZ_SIZE="8"))
    rc = stand_in_run_config(argv, world_size)
    p = rc.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size) == (1, 1, 32)
    assert (rc.deepspeed_zero_stage, p.zero_hpz_partition_size, rc.bf16) == (3, 8, True)
    assert rc.deepspeed_user_config["zero_optimization"] == {"stage": 3} and "data_types" not in rc.deepspeed_user_config
    out = tmp_path / "zero3.json"
    assert dry_run(argv + ["--dry-run", "--world-size", str(world_size), "--dry-run-json", str(out)],
                   out=io.StringIO()) == 0
    _, piped = script_argv(SCRIPT, tmp_path, dict(llama_files, ZERO_STAGE="3", PP_SIZE="2"))
    assert dry_run(piped + ["--dry-run", "--world-size", "32", "--dry-run-json", str(out)], out=io.StringIO()) == 1
    assert any("--zero-stage 3 does not combine with --pipeline-model-parallel-size 2" in problem
               for problem in json.loads(out.read_text())["problems"])


@pytest.mark.multiprocess
def test_tiny_llama_script_trains_under_zero3_with_tp(tmp_path):
    stdout, losses = train_cpu_example("pretrain_tiny_llama_cpu.sh", tmp_path,
                                       dict(TRAIN_ITERS="6", SAVE_INTERVAL="6", ZERO_STAGE="3", NPROC="4", TP="2",
                                            PP="1"), ["--eval-iters", "0"])
    assert "TP=2 PP=1 DP=2, ZeRO-3: optimizer state, gradients and parameters over DP=2" in stdout
    # bf16 where the CPU computes it in hardware, fp32 on AVX2 (as the main job chooses)
    assert f"precision: {default_precision()[0]} (" in stdout
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "global_step6"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tiny_llama_script_trains_and_exports_to_llama(tmp_path):
    from megatron.testing.tiny_corpus import make_tiny_corpus

    corpus = make_tiny_corpus(str(tmp_path / "corpus"))
    run_dir = tmp_path / "run"
    env = dict(os.environ, PY=sys.executable, RUN_DIR=str(run_dir), TRAIN_ITERS="12", SAVE_INTERVAL="12",
               DATA_PREFIX=corpus["data_prefix"], VOCAB_FILE=corpus["vocab_file"], MERGE_FILE=corpus["merge_file"],
               DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", str(EXAMPLES / "pretrain_tiny_llama_cpu.sh"), "--log-interval", "1",
                           "--tensorboard-log-interval", "1",
                           "--eval-interval", "12", "--eval-iters", "1"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    losses = [e.value for e in events.Scalars("lm-loss-training/lm loss")]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.5, losses
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "global_step12"

    from transformers import AutoModelForCausalLM

    from tools.convert_checkpoint import to_hf

    assert to_hf.main(["--load", str(run_dir / "checkpoints"), "--output-dir", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert (hf.config.num_key_value_heads, hf.config.tie_word_embeddings, hf.config.intermediate_size) == (4, False, 352)
