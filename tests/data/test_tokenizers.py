"""Tokenizers: GPT-2 BPE against Megatron's golden tokens, SentencePiece, local-only HF loading,
tokenizer training, and Megatron's vocabulary padding rules."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.config import TokenizerConfig
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.tokenizers import (
    GPT2BPETokenizer,
    PretrainedFromHF,
    SentencePieceTokenizer,
    build_tokenizer,
    pad_vocab_size,
    pieces_before_spaces,
    train_bpe_tokenizer,
    train_sentencepiece_tokenizer,
)

SAMPLES = ["Hello world!", "  leading spaces and\ttabs\n\nnew lines", "naïve café — 東京 🚀", ""]
TINY_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "A tokenizer splits text into pieces; the model sees only their ids.",
    "Pipeline parallelism splits the layers, tensor parallelism splits each layer.",
    "Data parallel ranks each see a different micro-batch of the same global batch.",
] * 8


@pytest.fixture(scope="module")
def gpt2_tiny(shared_data):
    gpt2 = shared_data / "gpt2"
    return GPT2BPETokenizer(gpt2 / "gpt2-tiny-vocab.json", gpt2 / "gpt2-tiny-merges.txt")


def test_gpt2_ids_and_round_trip(gpt2_tiny):
    assert (gpt2_tiny.vocab_size, gpt2_tiny.eod, gpt2_tiny.pad) == (5000, 4999, 4999)
    for text in SAMPLES:
        assert gpt2_tiny.detokenize(gpt2_tiny.tokenize(text)) == text
    assert gpt2_tiny.tokenize_batch(SAMPLES) == [gpt2_tiny.tokenize(text) for text in SAMPLES]
    # Megatron's GPT-2 tokenizer splits a literal "<|endoftext|>" like any other text.
    assert 4999 not in gpt2_tiny.tokenize("a<|endoftext|>b")


def test_gpt2_matches_megatron_tokens(gpt2_tiny, shared_data):
    golden = MMapIndexedDataset(shared_data / "gpt2" / "meg-gpt2-openwebtext_text_document")
    with open(shared_data / "gpt2" / "openwebtext-1000.jsonl", encoding="utf-8") as f:
        texts = [json.loads(next(f))["text"] for _ in range(5)]
    for i, ids in enumerate(gpt2_tiny.tokenize_batch(texts)):
        np.testing.assert_array_equal(golden.get(i), np.array(ids + [4999]), err_msg=f"document {i}")


def test_build_tokenizer_names_missing_flag_and_file(shared_data, tmp_path):
    vocab = shared_data / "gpt2" / "gpt2-tiny-vocab.json"
    with pytest.raises(ValueError, match="--merge-file"):
        build_tokenizer(TokenizerConfig("GPT2BPETokenizer", vocab_file=vocab))
    with pytest.raises(ValueError, match="--merge-file .*nope.txt"):
        build_tokenizer(TokenizerConfig("GPT2BPETokenizer", vocab_file=vocab, merge_file=tmp_path / "nope.txt"))
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_tokenizer(TokenizerConfig("SentencePieceTokenizer"))
    with pytest.raises(ValueError, match="BertWordPieceLowerCase"):
        build_tokenizer(TokenizerConfig("BertWordPieceLowerCase"))


def test_trained_bpe_loads_as_gpt2_and_from_local_dir(tmp_path):
    files = train_bpe_tokenizer(TINY_TEXT, 300, tmp_path / "a")
    again = train_bpe_tokenizer(TINY_TEXT, 300, tmp_path / "b")
    for name in ("vocab.json", "merges.txt", "tokenizer.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert set(again) == set(files)
    gpt2 = build_tokenizer(TokenizerConfig("GPT2BPETokenizer", vocab_file=files["vocab_file"], merge_file=files["merge_file"]))
    from_dir = build_tokenizer(TokenizerConfig("PretrainedFromHF", tokenizer_name_or_path=tmp_path / "a"))
    from_json = PretrainedFromHF(files["tokenizer_json"])
    for tokenizer in (gpt2, from_dir, from_json):
        assert (tokenizer.eod, tokenizer.pad) == (0, 0)
        assert tokenizer.vocab_size == gpt2.vocab_size
    for text in SAMPLES + TINY_TEXT[:4]:
        ids = gpt2.tokenize(text)
        assert from_dir.tokenize(text) == ids == from_json.tokenize(text)
        assert from_dir.detokenize(ids) == text


def test_pretrained_from_hf_directory_without_tokenizer_json_goes_through_transformers(tmp_path):
    # transformers converts a Llama tokenizer.model as a BPE model: train one of that type.
    files = train_sentencepiece_tokenizer(TINY_TEXT, 400, tmp_path / "spm", model_type="bpe")
    local = tmp_path / "llama-style"
    local.mkdir()
    (local / "tokenizer.model").write_bytes(open(files["tokenizer_model"], "rb").read())
    (local / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "eos_token": "</s>", "bos_token": "<s>", "unk_token": "<unk>"}))
    via_transformers = PretrainedFromHF(local)
    direct = SentencePieceTokenizer(files["tokenizer_model"])
    assert via_transformers.eod == direct.eod == 2
    for text in TINY_TEXT[:4]:
        assert via_transformers.tokenize(text) == direct.tokenize(text)  # no BOS added
        assert via_transformers.detokenize(direct.tokenize(text)) == text
    assert via_transformers.tokenize_batch(TINY_TEXT[:2]) == direct.tokenize_batch(TINY_TEXT[:2])


def test_pretrained_from_hf_refuses_a_directory_transformers_loads_empty(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer",
                                                                "eos_token": "<|endoftext|>"}))
    with pytest.raises(ValueError, match="empty tokenizer"):
        PretrainedFromHF(tmp_path)


def test_pretrained_from_hf_does_not_download_hub_names(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache (tests/data/test_hf_cache.py: a full one)
    with pytest.raises(ValueError, match="'bigscience/bloom-560m' is not a local path and not in the local "
                                         "Hugging Face cache"):
        PretrainedFromHF("bigscience/bloom-560m")
    with pytest.raises(ValueError, match="--tokenizer-name-or-path"):
        build_tokenizer(TokenizerConfig("PretrainedFromHF"))


def test_sentencepiece_trained_on_tiny_text(tmp_path):
    files = train_sentencepiece_tokenizer(TINY_TEXT, 400, tmp_path)
    tokenizer = build_tokenizer(TokenizerConfig("SentencePieceTokenizer", tokenizer_model=files["tokenizer_model"]))
    assert isinstance(tokenizer, SentencePieceTokenizer)
    assert (tokenizer.eod, tokenizer.pad) == (2, 3)
    assert 256 < tokenizer.vocab_size <= 400  # 256 byte pieces, characters, pieces
    for text in TINY_TEXT[:4] + ["unseen: Zürich ∑"]:  # byte fallback covers unseen characters
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    assert tokenizer.tokenize_batch(TINY_TEXT[:3]) == [tokenizer.tokenize(t) for t in TINY_TEXT[:3]]


@pytest.mark.parametrize("orig, divisible_by, tp, expected", [
    (5000, 128, 1, 5120), (5000, 128, 2, 5120), (5000, 128, 4, 5120), (5121, 128, 2, 5376),
    (50257, 128, 1, 50304), (50257, 1, 1, 50257), (250680, 128, 4, 250880), (256, 128, 1, 256),
])
def test_pad_vocab_size_rounds_up_to_divisible_times_tp(orig, divisible_by, tp, expected):
    padded = pad_vocab_size(orig, divisible_by, tp)
    assert padded == expected
    assert padded % (divisible_by * tp) == 0 and padded - orig < divisible_by * tp


def test_pad_vocab_size_to_exact_size_and_its_errors():
    assert pad_vocab_size(250680, 128, 4, pad_vocab_size_to=250880) == 250880
    assert pad_vocab_size(5000, 128, 1, pad_vocab_size_to=5000) == 5000
    with pytest.raises(ValueError, match=r"pad_vocab_size_to=4096.*5000"):
        pad_vocab_size(5000, 128, 1, pad_vocab_size_to=4096)
    with pytest.raises(ValueError, match=r"pad_vocab_size_to=5001.*tensor_model_parallel_size=2"):
        pad_vocab_size(5000, 128, 2, pad_vocab_size_to=5001)
    with pytest.raises(ValueError, match="positive"):
        pad_vocab_size(5000, 128, 0)


@pytest.mark.parametrize("kind, flag", [("bpe", "tokenizer_name_or_path"), ("sentencepiece", "tokenizer_model")])
def test_train_tokenizer_tool_output_loads(tmp_path, kind, flag):
    from tools import train_tokenizer

    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": t, "title": "t"}) + "\n" for t in TINY_TEXT))
    out = tmp_path / "out"
    assert train_tokenizer.main(["--input", str(path), "--type", kind, "--vocab-size", "400",
                                 "--output-dir", str(out)]) == 0
    location = out if kind == "bpe" else out / "tokenizer.model"
    tokenizer_type = "PretrainedFromHF" if kind == "bpe" else "SentencePieceTokenizer"
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type, **{flag: location}))
    assert tokenizer.detokenize(tokenizer.tokenize(TINY_TEXT[1])) == TINY_TEXT[1]
    assert tokenizer.eod == (0 if kind == "bpe" else 2)
    if kind == "bpe":
        gpt2 = GPT2BPETokenizer(out / "vocab.json", out / "merges.txt")
        assert gpt2.tokenize(TINY_TEXT[2]) == tokenizer.tokenize(TINY_TEXT[2])


# Characters around which GPT-2's pre-tokenization could go wrong if cut carelessly: runs of spaces,
# other (Unicode) whitespace, digits, punctuation, contractions, multi-byte letters.
_TRICKY = " \t\n\u00a0\u3000\u2028ab.1'sé東🚀-"


@pytest.fixture(scope="module")
def trained_bpe(tmp_path_factory):
    files = train_bpe_tokenizer(TINY_TEXT, 300, tmp_path_factory.mktemp("bpe"))
    return (GPT2BPETokenizer(files["vocab_file"], files["merge_file"]), PretrainedFromHF(files["tokenizer_json"]))


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=_TRICKY, max_size=80), piece_chars=st.integers(1, 12))
def test_long_texts_tokenized_in_pieces_give_the_ids_of_the_whole(trained_bpe, text, piece_chars):
    pieces = list(pieces_before_spaces(text, piece_chars))
    assert "".join(pieces) == text
    assert all(p.startswith(" ") and not q[-1:].isspace() for q, p in zip(pieces, pieces[1:]))
    for tokenizer in trained_bpe:
        assert tokenizer.cuts_before_spaces
        parts = list(tokenizer.tokenize_long(text, piece_chars))
        assert [i for part in parts for i in part] == tokenizer.tokenize(text)


def test_only_gpt2_style_tokenizer_json_is_cut(tmp_path):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    def saved(name, pre_tokenizer, normalizer=None):
        tokenizer = Tokenizer(models.WordLevel({"</s>": 0, "[UNK]": 1}, unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizer
        if normalizer is not None:
            tokenizer.normalizer = normalizer
        tokenizer.save(str(tmp_path / name))
        return PretrainedFromHF(tmp_path / name)

    assert saved("byte.json", pre_tokenizers.ByteLevel(add_prefix_space=False)).cuts_before_spaces
    assert not saved("prefix.json", pre_tokenizers.ByteLevel(add_prefix_space=True)).cuts_before_spaces
    assert not saved("meta.json", pre_tokenizers.Metaspace()).cuts_before_spaces  # SentencePiece-style
    assert not saved("nfkc.json", pre_tokenizers.ByteLevel(add_prefix_space=False), normalizers.NFKC()).cuts_before_spaces
    whole = saved("meta2.json", pre_tokenizers.Metaspace())
    assert list(whole.tokenize_long("a b " * 10, 3)) == [whole.tokenize("a b " * 10)]  # one piece: not cut
