"""The mixture-of-experts examples: examples/slurm/mixtral-8x7b.slurm's flags are a Mixtral-8x7B (46.7B
parameters, 8 experts top-2, EP=8 inside a node) that ``--dry-run`` plans on 64 H100s, and
examples/pretrain_tiny_moe_cpu.sh trains a tiny MoE on 4 CPU processes with expert parallelism."""

from __future__ import annotations

import pytest

from megatron.planner import model_shape_of
from tests.helpers import examples
from tests.helpers.examples import script_argv, stand_in_run_config

SCRIPT = examples.EXAMPLES / "slurm" / "mixtral-8x7b.slurm"


@pytest.fixture(scope="module")
def mixtral_files(tmp_path_factory):
    """Stand-ins for the dataset and Mistral's tokenizer.model (padded to 32,000 rows either way)."""
    return examples.sentencepiece_stand_ins(tmp_path_factory.mktemp("mixtral"), "mixtral_text_document")


def test_mixtral_script_is_mixtral_8x7b(mixtral_files, tmp_path):
    world_size, argv = script_argv(SCRIPT, tmp_path, mixtral_files)
    assert world_size == int(examples.sbatch_option(SCRIPT, "nodes")) * 8 == 64
    rc = stand_in_run_config(argv, world_size)
    m, p, moe = rc.model, rc.parallel, rc.model.moe
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.ffn_size, m.seq_length) == \
        (32, 4096, 32, 8, 14336, 4096)
    assert (moe.num_experts, moe.router_topk, m.expert_ffn_size, moe.expert_capacity_factor) == (8, 2, 14336, None)
    assert all(moe.layer_pattern) and moe.aux_loss_coeff == 0.02 and m.rotary_base == 1e6
    assert model_shape_of(m, 32000).total_params() == 46_702_792_704  # transformers' Mixtral-8x7B count
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size,
            p.expert_model_parallel_size) == (1, 2, 32, 8)
    assert rc.bf16 and rc.deepspeed_zero_stage == 1 and rc.training.checkpoint_activations
    assert rc.batch.global_batch_size * m.seq_length == 4 * 1024 ** 2


def test_mixtral_dry_run_plan(mixtral_files, tmp_path):
    world_size, argv = script_argv(SCRIPT, tmp_path, mixtral_files)
    status, report = examples.dry_run_report(argv, world_size, tmp_path / "plan.json", "--dry-run-gpu", "H100-80GB")
    assert status == 0 and report["ok"] and report["problems"] == [], report["problems"]
    assert report["memory"]["fits"] and 40 < report["memory"]["peak_gib"] < 60, report["memory"]
    experts = report["experts"]
    assert (experts["experts_per_rank"], experts["expert_data_parallel_size"]) == (1, 4)
    # 16 MoE layers per stage, one expert each: 3 x 4096 x 14336 parameters per layer
    assert [s["expert_params_per_rank"] for s in experts["stages"]] == [16 * 3 * 4096 * 14336] * 2
    # per stage and step: 32 micro-batches x 16 layers x (3 passes x 2 exchanges) x 4096 x 2 choices x 4096 x 2 B,
    # plus a routing weight per row (2 B): the two forwards' received and the backward's returned, and the counts
    handed = 32 * 16 * (6 * 4096 * 2 * 4096 * 2 + 3 * 4096 * 2 * 2 + 2 * 8 * 8)
    assert [s["all_to_all_gib"] for s in experts["stages"]] == [round(handed / 2 ** 30, 4)] * 2
    # EP not dividing the experts is refused before anything starts, naming both
    _, bad = script_argv(SCRIPT, tmp_path, dict(mixtral_files, EP_SIZE="16"))
    status, report = examples.dry_run_report(bad, 64, tmp_path / "bad.json")
    assert status == 1 and any("--num-experts 8 is not divisible by --expert-model-parallel-size 16" in problem
                               for problem in report["problems"])


@pytest.mark.multiprocess
def test_tiny_moe_script_trains_with_expert_parallelism(tmp_path):
    """Shrunk (2 processes, EP = 2 over DP = 2, seq 32, micro-batch 1) to keep the launch short."""
    _, losses = examples.train_cpu_example("pretrain_tiny_moe_cpu.sh", tmp_path,
                                  dict(TRAIN_ITERS="4", SAVE_INTERVAL="4", PRECISION="fp32", NPROC="2", PP="1"),
                                  ["--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
                                   "--eval-iters", "0"])
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "global_step4"
