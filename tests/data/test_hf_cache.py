"""--tokenizer-name-or-path as a hub name: found in a LOCAL Hugging Face cache laid out by hand as
huggingface_hub lays it out, loaded like the local path it points to, never downloaded, and a clear
error naming the cache when the name is not there."""

import pathlib
import socket

import pytest

from megatron.arguments import run_config_from_argv
from megatron.config import TokenizerConfig
from megatron.data.hf_cache import hub_cache_dir, resolve_tokenizer_path
from megatron.data.tokenizers import GPT2BPETokenizer, PretrainedFromHF, build_tokenizer
from megatron.testing import tiny_argv
from tests.helpers.data import COMMIT, fill_hub_cache

NAME = "bigscience-catalogue-data-dev/test-tok"  # BLOOM-176B's --tokenizer-name-or-path
TEXTS = ["The model sees only token ids.", "  spaces,\ttabs\nand pipeline stage 42 ", "naïve café — 東京"]


@pytest.fixture
def hub_cache(tiny_corpus, tmp_path, monkeypatch) -> pathlib.Path:
    """HF_HUB_CACHE pointed at a cache holding NAME: the tiny corpus's trained tokenizer.json."""
    tokenizer_json = pathlib.Path(tiny_corpus["vocab_file"]).parent / "tokenizer.json"
    cache = tmp_path / "hub"
    fill_hub_cache(cache, NAME, {"tokenizer.json": tokenizer_json.read_bytes(),
                                 "tokenizer_config.json": b'{"eos_token": "<|endoftext|>"}'})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_a_cached_hub_name_loads_and_encodes_as_the_local_path(hub_cache, tiny_corpus):
    snapshot = resolve_tokenizer_path(NAME)
    assert pathlib.Path(snapshot) == hub_cache / f"models--{NAME.replace('/', '--')}" / "snapshots" / COMMIT
    local_dir = pathlib.Path(tiny_corpus["vocab_file"]).parent
    assert resolve_tokenizer_path(local_dir) == str(local_dir)  # a local path is taken as it is
    by_name = build_tokenizer(TokenizerConfig("PretrainedFromHF", tokenizer_name_or_path=NAME))
    by_path = PretrainedFromHF(local_dir / "tokenizer.json")
    gpt2 = GPT2BPETokenizer(tiny_corpus["vocab_file"], tiny_corpus["merge_file"])  # what the corpus was tokenized with
    assert (by_name.vocab_size, by_name.eod) == (by_path.vocab_size, by_path.eod) == (gpt2.vocab_size, gpt2.eod)
    for text in TEXTS:
        ids = by_path.tokenize(text)
        assert len(ids) > 3 and by_name.tokenize(text) == ids == gpt2.tokenize(text)
        assert by_name.detokenize(ids) == text


def test_the_command_line_takes_a_cached_hub_name(hub_cache, tiny_corpus):
    local = pathlib.Path(tiny_corpus["vocab_file"]).parent / "tokenizer.json"
    flags = dict(tokenizer_type="PretrainedFromHF", vocab_file=None, merge_file=None)
    by_name = run_config_from_argv(tiny_argv(tiny_corpus, tokenizer_name_or_path=NAME, **flags), world_size=1)
    by_path = run_config_from_argv(tiny_argv(tiny_corpus, tokenizer_name_or_path=local, **flags), world_size=1)
    assert by_name.data.tokenizer.tokenizer_name_or_path == NAME  # the name is what is recorded
    assert (by_name.model.original_vocab_size, by_name.model.padded_vocab_size) == \
        (by_path.model.original_vocab_size, by_path.model.padded_vocab_size) == (400, 512)


def test_a_name_not_in_the_cache_is_an_error_naming_cache_variables_and_fix(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HOME", "/somewhere/hf-home")
    missing = "bigscience/tokenizer"
    with pytest.raises(ValueError) as info:
        resolve_tokenizer_path(missing)
    message = str(info.value)
    for words in (f"'{missing}' is not a local path and not in the local Hugging Face cache",
                  str(hub_cache / "models--bigscience--tokenizer"), f"cache folder searched is {hub_cache}",
                  f"HF_HUB_CACHE='{hub_cache}'", "HF_HOME='/somewhere/hf-home'",
                  f"HF_HUB_CACHE={hub_cache} hf download {missing}", f"huggingface-cli download {missing}",
                  "or pass a local path"):
        assert words in message, (words, message)
    with pytest.raises(ValueError, match="'bigscience/tokenizer' is not a local path"):
        PretrainedFromHF(missing)  # the builder says the same
    # a snapshot whose refs/main names a commit with no folder is not found either
    fill_hub_cache(hub_cache, missing, {})
    (hub_cache / "models--bigscience--tokenizer" / "refs" / "main").write_text("f" * 40)
    with pytest.raises(ValueError, match="no complete snapshot of revision 'main'"):
        resolve_tokenizer_path(missing)


def test_no_network_is_touched_even_with_offline_mode_off(hub_cache, monkeypatch):
    import huggingface_hub.constants

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access: {args}")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    assert resolve_tokenizer_path(NAME).endswith(COMMIT)
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        resolve_tokenizer_path("bigscience/not-cached")


def test_the_cache_folder_follows_huggingface_hub_environment(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub_cache_dir() == str(tmp_path / ".cache" / "huggingface" / "hub")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert hub_cache_dir() == "/xdg/huggingface/hub"
    monkeypatch.setenv("HF_HOME", "~/hf")
    assert hub_cache_dir() == str(tmp_path / "hf" / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", "/hub-cache")
    assert hub_cache_dir() == "/hub-cache"
