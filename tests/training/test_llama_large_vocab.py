"""A Llama-3-style vocabulary (more than 65,535 tokens, so tokens are stored as int32) end to end: a
tokenizer trained here (a byte-level BPE plus 70,000 reserved special tokens, as Llama 3 reserves some),
tools/preprocess_data.py, then a Llama-style model trains on it reading ids above 65,535."""

import json
import math

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.tokenizers import train_bpe_tokenizer
from megatron.testing import run_distributed, tiny_argv
from megatron.testing.tiny_corpus import make_text
from tests.helpers.training import train
from tools import preprocess_data

RESERVED = 70_000


@pytest.fixture(scope="module")
def large_vocab(tmp_path_factory):
    from tokenizers import AddedToken, Tokenizer

    d = tmp_path_factory.mktemp("vocab70k")
    texts = make_text(300, seed=0)
    path = train_bpe_tokenizer(texts, 500, d / "tokenizer")["tokenizer_json"]
    tokenizer = Tokenizer.from_file(path)
    tokenizer.add_special_tokens([AddedToken(f"<|reserved_{i}|>", special=True) for i in range(RESERVED)])
    tokenizer.save(path)
    high = tokenizer.token_to_id(f"<|reserved_{RESERVED - 1}|>")
    with open(d / "corpus.jsonl", "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):  # every other document carries the highest id
            f.write(json.dumps({"text": text + (f" <|reserved_{RESERVED - 1}|>" if i % 2 else "")}) + "\n")
    assert preprocess_data.main(["--input", str(d / "corpus.jsonl"), "--output-prefix", str(d / "data"),
                                 "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", path,
                                 "--append-eod", "--workers", "1"]) == 0
    return {"tokenizer": path, "prefix": str(d / "data_text_document"), "high_id": high,
            "vocab_size": tokenizer.get_vocab_size()}


def test_preprocess_stores_ids_above_65535_as_int32(large_vocab):
    assert large_vocab["vocab_size"] > 65_535 and large_vocab["high_id"] > 65_535
    dataset = MMapIndexedDataset(large_vocab["prefix"])
    assert dataset.dtype == np.int32
    tokens = np.concatenate([dataset[i] for i in range(len(dataset))])
    assert tokens.max() == large_vocab["high_id"] and (tokens == large_vocab["high_id"]).sum() == 150


@pytest.mark.multiprocess
def test_llama_trains_on_the_large_vocabulary(large_vocab, tiny_corpus):
    argv = tiny_argv(tiny_corpus, "--normalization", "rmsnorm", "--swiglu", "--num-key-value-heads", "2",
                     "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96",
                     train_iters=6, position_embedding_type="rope", embed_layernorm=False,
                     tokenizer_type="PretrainedFromHF", tokenizer_name_or_path=large_vocab["tokenizer"],
                     vocab_file=None, merge_file=None, data_path=large_vocab["prefix"], lr=3e-3)
    (run,) = run_distributed(train, world_size=1, args=([argv],), timeout=600)[0]
    losses = [loss for _, loss, *_ in run["history"]]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    # a uniform guess over the padded 70,528 rows costs ln(70528) = 11.16; training starts there and learns
    assert abs(losses[0] - math.log(70_528)) < 0.5 and losses[-1] < losses[0] - 0.5, losses
