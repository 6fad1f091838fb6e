"""Real Megatron-LM and Megatron-DeepSpeed launch scripts through ``--dry-run`` (tests/helpers/upstream_scripts.py
holds their flags), and the pieces they needed: Megatron's tokenizer types and default, the table of flags with no
effect here or refused (megatron/arguments/upstream_flags.py), and Megatron-DeepSpeed's token-based schedule."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from megatron.arguments.check import check_argv
from megatron.arguments.upstream_flags import BY_FLAG, NO_EFFECT, UPSTREAM_FLAGS
from tests.helpers.upstream_scripts import SCRIPTS, script_argv, write_script_corpus

TEXTS = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine", "pack my box with five dozen",
         "liquor jugs and the sphinx of black quartz judge my vow"] * 20


@pytest.fixture(scope="module")
def script_files(tmp_path_factory):
    """What the scripts' paths name, built small: a SentencePiece model (with BOS and EOS), GPT-2 BPE files, a Hugging
    Face tokenizer folder, and one indexed dataset whose ids fit every one of those vocabularies."""
    from megatron.data.tokenizers import train_bpe_tokenizer, train_sentencepiece_tokenizer

    tmp = tmp_path_factory.mktemp("scripts")
    sp = train_sentencepiece_tokenizer(TEXTS, 300, tmp / "sp")
    (tmp / "tokenizer.model").write_bytes(open(sp["tokenizer_model"], "rb").read())
    bpe = train_bpe_tokenizer(TEXTS, 300, tmp / "hf_tokenizer")
    (tmp / "gpt2-vocab.json").write_bytes(open(bpe["vocab_file"], "rb").read())
    (tmp / "gpt2-merges.txt").write_bytes(open(bpe["merge_file"], "rb").read())
    (tmp / "hf_tokenizer" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    write_script_corpus(tmp, 250, np.uint16)
    return tmp


def _check(name, tmp):
    script = SCRIPTS[name]
    ds_config = None
    if script["ds_config"] is not None:
        ds_config = tmp / f"{name}.json"
        ds_config.write_text(json.dumps(script["ds_config"]))
    argv = script_argv(name, tmp, ds_config)
    return argv, check_argv(argv + ["--dry-run", "--world-size", str(script["world_size"])])


def _upstream_flags_in(argv):
    return [BY_FLAG[token] for token in argv if token in BY_FLAG]


@pytest.mark.parametrize("name", ["mds_llama2", "mds_universal_llama", "mds_zbh1", "mlm_mixtral_8x7b", "mlm_llama3_8b"])
def test_script_passes_dry_run_with_every_flag_accounted_for(script_files, name):
    argv, check = _check(name, script_files)
    assert check.ok, check.problems
    assert not check.not_checked, check.not_checked
    assert check.run_config is not None and check.run_config.model.padded_vocab_size is not None
    # every no-effect flag the script passes says so at startup, once
    for row in _upstream_flags_in(argv):
        assert row.effect == NO_EFFECT
        assert sum(w.startswith(row.flag + " ") for w in check.warnings) == 1, (row.flag, check.warnings)


def test_mds_zbh1_trains_on_its_token_budget_with_a_token_schedule(script_files):
    rc = _check("mds_zbh1", script_files)[1].run_config
    assert rc.training.train_tokens == 300_000_000_000 and rc.lr_schedule.lr_decay_tokens == 300_000_000_000
    assert rc.lr_schedule_lengths() == (3_000_000_000, 300_000_000_000, 2048)
    assert rc.parallel.pipeline_model_parallel_size == 8 and rc.fp16


def test_mlm_mixtral_maps_megatron_lm_names(script_files):
    argv, check = _check("mlm_mixtral_8x7b", script_files)
    rc = check.run_config
    assert rc.precision.zero_stage == 1  # --use-distributed-optimizer; bf16 would have given 1 as well
    assert rc.parallel.expert_model_parallel_size == 8 and rc.data.tokenizer.tokenizer_type == "Llama2Tokenizer"


def test_mlm_llama3_fp8_passes(script_files):
    """Llama-3-8B's FP8 example passes: its --fp8-* flags with their meanings, the split's quotes, --kv-channels 128 =
    4096 / 32, --attention-backend fused, the decoupled learning rate, zero-centred norms, bf16 gradient reduction."""
    argv, check = _check("mlm_llama3_8b", script_files)
    fp8 = check.run_config.model.fp8
    assert (fp8.fp8_format, fp8.fp8_recipe, fp8.fp8_amax_history_len, fp8.fp8_amax_compute_algo) == \
        ("hybrid", "delayed", 1024, "max")
    assert any(w.startswith("--fp8-param-gather has no effect") for w in check.warnings), check.warnings
    assert check.run_config.data.split == "99,1,0" and check.run_config.model.attention_backend == "sdpa"
    assert (check.run_config.optimizer.decoupled_lr, check.run_config.optimizer.decoupled_min_lr) == (5e-4, 4.5e-5)
    assert check.run_config.model.apply_layernorm_1p and check.run_config.precision.grad_reduce_in_bf16
    assert any(w.startswith("--attention-backend fused (Megatron-LM's name) runs as") for w in check.warnings)


def test_refused_and_value_rules(script_files):
    argv, _ = _check("mds_llama2", script_files)
    for extra, expected in ((["--rotary-percent", "0.5"], "--rotary-percent 0.5: partial rotary"),
                            (["--calculate-per-token-loss", "--eod-mask-loss", "--context-parallel-size", "2"],
                             "--calculate-per-token-loss with --eod-mask-loss divides by the global batch"),
                            (["--fp8-format", "hybrid", "--fp16"], "--fp8-format with --fp16 is not supported"),
                            (["--no-pipeline-parallel"], "--no-pipeline-parallel with --pipeline-model-parallel-size 2"),
                            (["--use-megatron-fsdp"], "--use-megatron-fsdp: not supported here: Megatron-FSDP"),
                            (["--rotary-seq-len-interpolation-factor", "2"],
                             "--rotary-seq-len-interpolation-factor 2.0: linear position interpolation is not"),
                            (["--use-distributed-optimizer", "--zero-stage", "0", "--fp16"],
                             "--use-distributed-optimizer shards the optimizer states")):
        check = check_argv([t for t in argv if t != "--bf16"] + extra + ["--dry-run", "--world-size", "8"]
                           if "--fp16" in extra else argv + extra + ["--dry-run", "--world-size", "8"])
        assert any(p.startswith(expected) for p in check.problems), (extra, check.problems)


def test_kv_channels_sets_a_head_size_of_its_own(script_files):
    from megatron.dry_run.report import build_report
    from megatron.dry_run.text import render

    """--kv-channels other than hidden / heads is Megatron-LM's head size (Qwen3's): accepted, it sets the model's
    head size and so the attention's parameter count; an odd one with rotary positions is refused."""
    argv, base = _check("mds_llama2", script_files)
    check = check_argv(argv + ["--kv-channels", "64", "--dry-run", "--world-size", "8"])
    assert check.problems == [] and check.run_config.model.kv_channels == 64, check.problems
    model, before = check.run_config.model, base.run_config.model
    assert model.head_dim == 64 != before.head_dim and model.query_hidden_size == model.num_attention_heads * 64
    report = build_report(argv + ["--kv-channels", "64", "--dry-run", "--world-size", "8"])
    assert report["model"]["head_dim"] == 64 and f"{model.num_attention_heads} heads of 64 (--kv-channels)" in \
        render(report)
    odd = check_argv(argv + ["--kv-channels", "63", "--dry-run", "--world-size", "8"])
    assert any("rotary positions need an even head dimension, got 63 (--kv-channels)" in p for p in odd.problems)


def test_older_upstream_spellings(files):
    from tests.helpers.arguments import parse

    assert parse(files, drop=(), dataset_impl="mmap").data.data_impl == "mmap"
    assert parse(files, recompute_activations=True).model.recompute_core_attention  # = selective
    with pytest.raises(ValueError, match="--recompute-activations .selective recomputation. contradicts"):
        parse(files, recompute_activations=True, recompute_granularity="full")


def test_the_table_is_in_the_docs_and_each_row_is_a_flag():
    from megatron.arguments import build_parser

    parser = build_parser()
    doc = (__import__("pathlib").Path(__file__).resolve().parents[2] / "docs" / "flags.md").read_text()
    for row in UPSTREAM_FLAGS:
        assert row.flag in parser._option_string_actions
        assert f"`{row.flag}`" in doc, row.flag


# ---- tokenizers

def test_llama2_and_gpt_sentencepiece_tokenizers(script_files):
    import sentencepiece

    from megatron.config import TokenizerConfig
    from megatron.data.tokenizers import build_tokenizer

    model = str(script_files / "tokenizer.model")
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    text = "the quick brown fox"
    llama2 = build_tokenizer(TokenizerConfig("Llama2Tokenizer", tokenizer_model=model))
    gpt_sp = build_tokenizer(TokenizerConfig("GPTSentencePieceTokenizer", tokenizer_model=model))
    assert llama2.tokenize(text) == [sp.bos_id()] + sp.encode(text)   # Megatron-LM's: BOS first
    assert gpt_sp.tokenize(text) == sp.encode(text)
    assert llama2.tokenize_batch([text, "nine"]) == [[sp.bos_id()] + sp.encode(t) for t in (text, "nine")]
    assert llama2.eod == gpt_sp.eod == sp.eos_id() and llama2.vocab_size == sp.get_piece_size()
    assert llama2.detokenize(llama2.tokenize(text)) == text


def test_huggingface_tokenizer_adds_the_tokenizers_special_tokens(script_files, tmp_path):
    """Megatron-LM's HuggingFaceTokenizer tokenizes as transformers does with its defaults (special tokens added:
    here a BOS put first by the tokenizer's post-processor); its eos ends documents."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    from megatron.config import TokenizerConfig
    from megatron.data.tokenizers import build_tokenizer

    folder = tmp_path / "llama3_like"
    folder.mkdir()
    tok = Tokenizer.from_file(str(script_files / "hf_tokenizer" / "tokenizer.json"))
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>",
                                                                                                  bos)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                              "bos_token": "<|endoftext|>"}))
    ours = build_tokenizer(TokenizerConfig("HuggingFaceTokenizer", tokenizer_model=str(folder)))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|endoftext|>")
    for text in TEXTS[:4]:
        assert ours.tokenize(text) == hf(text).input_ids and ours.tokenize(text)[0] == bos
    assert ours.tokenize_batch(TEXTS[:2]) == [hf(t).input_ids for t in TEXTS[:2]]
    assert ours.eod == hf.eos_token_id and ours.vocab_size == len(hf)
    # PretrainedFromHF, BLOOM's, adds nothing
    plain = build_tokenizer(TokenizerConfig("PretrainedFromHF", tokenizer_name_or_path=str(folder)))
    assert plain.tokenize(TEXTS[0]) == hf(TEXTS[0], add_special_tokens=False).input_ids


def test_gpt2bpe_is_the_default_tokenizer_type(script_files):
    argv, _ = _check("mds_zbh1", script_files)
    assert "--tokenizer-type" not in argv
    check = check_argv([t for t in argv if not t.startswith("--vocab-file") and "gpt2-vocab" not in t]
                       + ["--dry-run", "--world-size", "16"])
    assert any("--tokenizer-type GPT2BPETokenizer needs --vocab-file (GPT2BPETokenizer is the default" in p
               for p in check.problems), check.problems


# ---- Megatron-DeepSpeed's token-based schedule

def _mds_lr(num_tokens, *, max_lr, min_lr, warmup_tokens, decay_tokens, style):
    """Megatron-DeepSpeed's OptimizerParamScheduler.get_lr with lr_warmup_tokens / lr_decay_tokens set, written
    from its definition: linear warm-up over the warm-up tokens, then the decay style over the rest of the decay
    tokens, then min_lr."""
    if warmup_tokens > 0 and num_tokens <= warmup_tokens:
        return max_lr * num_tokens / warmup_tokens
    if num_tokens > decay_tokens:
        return min_lr
    ratio = (num_tokens - warmup_tokens) / (decay_tokens - warmup_tokens)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


@pytest.mark.parametrize("style", ["cosine", "linear"])
def test_token_schedule_equals_megatron_deepspeeds_formula(files, style):
    """A run of 8-sample, 32-token steps (256 tokens each) whose warm-up (1000 tokens) and decay (7000 tokens) end
    inside steps: the rate of every step is the formula's at the tokens consumed before it, and the run stops on
    its token budget (--train-tokens 9000: 36 steps, the 36th crossing it) before --train-iters."""
    from megatron.dry_run.plan import RunSteps
    from megatron.training.lr_schedule import LRScheduler
    from tests.helpers.arguments import parse

    rc = parse(files, world_size=1, micro_batch_size=8, global_batch_size=8, train_iters=100, lr_warmup_tokens=1000,
               lr_decay_tokens=7000, train_tokens=9000, lr=1e-3, min_lr=1e-4, lr_decay_style=style)
    scheduler = LRScheduler.from_run_config(None, rc)
    for step in range(40):
        assert scheduler.get_lr() == pytest.approx(_mds_lr(step * 256, max_lr=1e-3, min_lr=1e-4, warmup_tokens=1000,
                                                           decay_tokens=7000, style=style), rel=1e-12, abs=0)
        scheduler.step(8)
    assert scheduler.state_dict()["num_steps"] == 40 * 256 and scheduler.state_dict()["tokens_per_sample"] == 32
    assert RunSteps(rc).num_iterations == 36


def test_token_decay_after_an_iteration_warmup(files):
    """Megatron-DeepSpeed's mixed case: warm-up in iterations, decay in tokens from the tokens at the warm-up's end."""
    from megatron.training.lr_schedule import LRScheduler
    from tests.helpers.arguments import parse

    rc = parse(files, world_size=1, micro_batch_size=8, global_batch_size=8, lr_warmup_iters=3, lr_decay_tokens=5000,
               lr=1e-3, min_lr=0.0, lr_decay_style="linear")
    scheduler = LRScheduler.from_run_config(None, rc)
    lrs = [scheduler.step(8) for _ in range(25)]
    expected = [_mds_lr(256 * (i + 1), max_lr=1e-3, min_lr=0.0, warmup_tokens=768, decay_tokens=5000,
                        style="linear") for i in range(25)]
    assert lrs == pytest.approx(expected, rel=1e-12, abs=0)


def test_token_schedule_flag_rules(files):
    from tests.helpers.arguments import parse

    with pytest.raises(ValueError, match="--lr-warmup-tokens 100 needs --lr-decay-tokens"):
        parse(files, lr_warmup_tokens=100)
    with pytest.raises(ValueError, match="give one non-negative warm-up"):
        parse(files, lr_warmup_tokens=100, lr_decay_tokens=1000, lr_warmup_iters=2)


def test_port_tool_says_what_each_flag_becomes(script_files, tmp_path, capsys):
    from tools import port_megatron_args

    script = SCRIPTS["mlm_mixtral_8x7b"]
    argv = script_argv("mlm_mixtral_8x7b", script_files)
    flags_file = tmp_path / "flags.txt"
    flags_file.write_text("# Mixtral's flags\n" + " ".join(argv) + "\n")
    assert port_megatron_args.main(["--world-size", str(script["world_size"]), "--args-file", str(flags_file)]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("--")}
    assert set(lines) == {t for t in argv if t.startswith("--")}
    assert "no effect here" in lines["--overlap-grad-reduce"] and "overlap" in lines["--overlap-grad-reduce"]
    assert "implemented" in lines["--use-distributed-optimizer"]
    assert "pretrain_gpt.py --dry-run at 32 processes: passes" in out
    assert port_megatron_args.main(["--world-size", "32", "--", *argv, "--use-megatron-fsdp", "--bogus"]) == 1
    out = capsys.readouterr().out
    assert "refused" in out.split("--use-megatron-fsdp", 1)[1].splitlines()[0]
    assert "unknown" in out.split("\n--bogus", 1)[1].splitlines()[0]
