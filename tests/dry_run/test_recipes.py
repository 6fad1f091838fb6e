"""Megatron-MoE-ModelZoo's H100 recipes for DeepSeek-V3 (1024 GPUs) and Qwen3-235B-A22B (256 GPUs), their flags as
the launch scripts expand them (tests/helpers/upstream_scripts.py), through ``--dry-run`` at their world sizes: what
runs as the recipe says, what is refused and why, and the memory the planner gives each GPU, term by term against
parameter counts written out by hand.

The tokenizers are stand-ins with the real ones' sizes (DeepSeek-V3's 128,815 tokens, Qwen3's 151,669), so the
vocabularies pad to the models' 129,280 and 151,936 rows as Megatron-LM pads them (--make-vocab-size-divisible-by
x TP).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron.arguments.check import check_argv
from megatron.arguments.upstream_flags import BY_FLAG, NO_EFFECT
from tests.helpers.upstream_scripts import SCRIPTS, script_argv, write_script_corpus

DEEPSEEK, QWEN = "moe_zoo_deepseek_v3_h100", "moe_zoo_qwen3_235b_h100"
GiB = 1024 ** 3

def _word_level_tokenizer(folder, size: int) -> None:
    """A Hugging Face tokenizer folder of ``size`` tokens (the last one the end of document)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir()
    vocab = {f"t{i}": i for i in range(size - 1)}
    vocab["<|endoftext|>"] = size - 1
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


@pytest.fixture(scope="module")
def recipe_files(tmp_path_factory):

    tmp = tmp_path_factory.mktemp("recipes")
    _word_level_tokenizer(tmp / "deepseek_v3_tokenizer", 128_815)
    _word_level_tokenizer(tmp / "qwen3_tokenizer", 151_669)
    write_script_corpus(tmp, 128_000, np.int32)
    return tmp


def _argv(name, tmp) -> tuple[list[str], list[str]]:
    """(the recipe's whole argv, the argv run here: it with --dry-run at its world size)."""
    full = script_argv(name, tmp)
    return full, full + ["--dry-run", "--world-size", str(SCRIPTS[name]["world_size"])]


@pytest.fixture(scope="module")
def checks(recipe_files):
    return {name: check_argv(_argv(name, recipe_files)[1]) for name in (DEEPSEEK, QWEN)}


@pytest.fixture(scope="module")
def reports(recipe_files):
    from megatron.dry_run.report import build_report

    return {name: build_report(_argv(name, recipe_files)[1] + ["--dry-run-gpu", "H100-80GB"])
            for name in (DEEPSEEK, QWEN)}


@pytest.mark.parametrize("name", [DEEPSEEK, QWEN])
def test_recipe_passes_dry_run_at_its_world_size(recipe_files, checks, name):
    full, argv = _argv(name, recipe_files)
    check = checks[name]
    assert check.ok, check.problems
    assert not check.not_checked, check.not_checked
    assert check.world_size == SCRIPTS[name]["world_size"]
    # every no-effect flag of the recipe says so at startup, once
    for flag in [token for token in argv if token in BY_FLAG]:
        assert BY_FLAG[flag].effect == NO_EFFECT, flag
        assert sum(w.startswith(flag + " ") for w in check.warnings) == 1, (flag, check.warnings)
    assert "--recompute-modules" in full and argv[:len(full)] == full  # the whole recipe ran


def test_deepseek_v3_recipe_is_what_it_says(checks):
    """TP 2 with SP, 8 stages of 4 virtual stages from the layout 'Et|(tt|)*30mL' (the embedding and layer 0, then
    two layers each, the MTP depth and the loss last), EP 64 of whole experts, MLA with its latent norms, one MTP
    depth weighted 0.1, YaRN x40, FP8 blockwise e4m3, Adam's moments in bf16, DeepSeek-V3's router."""
    rc = checks[DEEPSEEK].run_config
    p, m = rc.parallel, rc.model
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size,
            p.expert_tp, p.data_parallel_size) == (2, 8, 64, 1, 64) and m.sequence_parallel
    assert m.padded_vocab_size == 129_280 and (m.mla.q_lora_rank, m.mla.kv_lora_rank) == (1536, 512)
    assert m.qk_layernorm and m.mtp_num_layers == 1 and m.mtp_loss_scaling_factor == 0.1
    assert m.moe.num_experts == 256 and m.moe.layer_pattern == (False,) * 3 + (True,) * 58
    assert (m.moe.router_score_function, m.moe.router_topk, m.moe.router_num_groups, m.moe.router_group_topk,
            m.moe.router_topk_scaling_factor, m.moe.seq_aux_loss_coeff) == ("sigmoid", 8, 8, 4, 2.5, 1e-4)
    assert m.moe.router_enable_expert_bias and m.moe.token_dispatcher_type == "alltoall"  # flex runs as alltoall
    assert m.yarn_rotary_scaling_factor == 40 and m.fp8.fp8_recipe == "blockwise"
    assert (rc.optimizer.exp_avg_dtype, rc.optimizer.exp_avg_sq_dtype) == ("bf16", "bf16")
    assert rc.batch.global_batch_size == 8192 and rc.training.train_samples == 585_937_500


def test_qwen3_recipe_is_what_it_says(checks):
    """TP 2 with SP, 8 stages x 4 virtual of 3 'layers' where the embedding and the loss count as layers (94 + 2 = 96),
    EP 32 of whole experts, 64 query heads and 4 key / value heads of 128 (--kv-channels) with head norms."""
    rc = checks[QWEN].run_config
    p, m = rc.parallel, rc.model
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size,
            p.expert_tp, p.data_parallel_size) == (2, 8, 32, 1, 16) and m.sequence_parallel
    assert m.padded_vocab_size == 151_936 and (m.head_dim, m.num_kv_heads, m.qk_layernorm) == (128, 4, True)
    assert m.moe.num_experts == 128 and m.moe.router_topk == 8 and m.moe.aux_loss_coeff == 1e-3
    assert m.moe.router_dtype == "fp32" and not m.moe.router_pre_softmax
    assert m.moe.router_force_load_balancing  # the benchmark's random routing (balanced whatever the tokens)


def _stage_weights_by_hand(name) -> int:
    """The parameters one rank of pipeline stage 1 holds (its 8 MoE layers of DeepSeek-V3; its 12 layers of Qwen3),
    from the models' configs, split as TP 2 and EP (whole experts) split them."""
    if name == DEEPSEEK:
        h, heads, dq, dc, dn, dr, dv, fe, E, ep = 7168, 128, 1536, 512, 128, 64, 128, 2048, 256, 64
        split = heads * ((dn + dr) * dq + (dn + dv) * dc + dv * h) + 3 * h * fe   # up / output proj., shared expert
        whole = (h + 1) * dq + h * (dc + dr) + dc + 2 * h + E * h                  # down-proj., norms, router
        return 8 * (split // 2 + whole + E // ep * 3 * h * fe)
    h, heads, kv, hn, fe, E, ep = 4096, 64, 4, 128, 1536, 128, 32
    split = (heads + 2 * kv) * hn * h + h * heads * hn                             # QKV, output projection
    whole = 2 * hn + 2 * h + E * h                                                 # head norms, norms, router
    return 12 * (split // 2 + whole + E // ep * 3 * h * fe)


@pytest.mark.parametrize("name", [DEEPSEEK, QWEN])
def test_recipe_memory_per_gpu(reports, name):
    """The planner's per-GPU memory of the busiest stage (stage 1), term by term: its bf16 weights are the
    parameters counted by hand (MLA's for DeepSeek-V3), the gradients as many in bf16 and twice as many in the fp32
    buffer; the activations are what the layers of 9.25 micro-batches in flight keep (interleaved 1F1B, v = 4)."""
    memory = reports[name]["memory"]
    assert reports[name]["ok"], reports[name]["problems"]
    assert memory["gpu"] == "H100-80GB" and memory["peak_stage"] == 1
    stage = memory["per_stage_gib"][1]
    weights = _stage_weights_by_hand(name)
    assert stage["weights"] == round(2 * weights / GiB, 2) == stage["grads"]
    assert stage["grad_buffer"] == round(4 * weights / GiB, 2)
    assert memory["peak_gib"] == pytest.approx(sum(stage.values()), abs=0.05)  # the terms rounded to 0.01 each
    assert reports[name]["schedule"]["in_flight_micro_batches"][1] == 9.25



def test_deepseek_v3_dry_run_text_names_its_mtp_depth(reports):
    from megatron.dry_run.text import render

    model_line = next(line for line in render(reports[DEEPSEEK]).splitlines() if line.startswith("model "))
    assert "1 MTP depth(s) weighted 0.1" in model_line, model_line
    assert "MTP" not in next(line for line in render(reports[QWEN]).splitlines() if line.startswith("model "))


@pytest.mark.parametrize("name", [DEEPSEEK, QWEN])
def test_recipe_fits_an_h100(reports, name):
    """Each recipe's busiest stage fits the 80 GiB of an H100 within --dry-run's 90% headroom (72 GiB): DeepSeek-V3
    69.6 GiB, Qwen3-235B 61.0 GiB. What made them fit (DeepSeek-V3 was at 97.6 GiB, Qwen3 at 75.1): the routing
    weights applied in the experts' activation, so no copy of the returned rows is kept for their gradient (76.5
    GiB), and the FP8 layers keeping their inputs as 1-byte FP8 operands (DeepSeek-V3's blockwise FP8: 69.6 GiB);
    both measured on CPU (tests/model/test_recompute_modules.py, tests/parallel/test_fp8_linear.py)."""
    memory = reports[name]["memory"]
    assert memory["fits"] and memory["peak_gib"] <= memory["limit_gib"] == 0.9 * 80.0, memory["peak_gib"]
