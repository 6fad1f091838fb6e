"""A tiny synthetic corpus for tests and benchmarks: text, a trained byte-level BPE, a .bin/.idx,
and ``tiny_argv``, the flags of a tiny model trained on it.

Deterministic from ``seed``; a few hundred documents of pseudo-sentences, built in about a second.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np

from megatron.config import TokenizerConfig
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from megatron.data.preprocess import PreprocessConfig, preprocess
from megatron.data.tokenizers import train_bpe_tokenizer

WORDS = ("the of and to in is was for on that with as by at from his her an were are which this be "
         "model data train layer weight token batch stage pipeline tensor parallel gradient loss rank "
         "north river city music year house school water light time world people government history").split()


def make_text(num_docs: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(num_docs):
        sentences = []
        for _ in range(rng.randint(2, 12)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
            sentences.append(" ".join(words).capitalize() + ".")
        docs.append(" ".join(sentences))
    return docs


def make_tiny_corpus(out_dir: str, num_docs: int = 300, vocab_size: int = 400, seed: int = 0) -> dict:
    """Write ``corpus.jsonl``, a tokenizer (``vocab.json``, ``merges.txt``) and ``corpus_text_document``."""
    os.makedirs(out_dir, exist_ok=True)
    docs = make_text(num_docs, seed)
    jsonl = os.path.join(out_dir, "corpus.jsonl")
    with open(jsonl, "w") as f:
        for text in docs:
            f.write(json.dumps({"text": text}) + "\n")
    tok = train_bpe_tokenizer(docs, vocab_size, os.path.join(out_dir, "tokenizer"))
    prefix = os.path.join(out_dir, "corpus")
    preprocess(PreprocessConfig(input=jsonl, output_prefix=prefix,
                                tokenizer=TokenizerConfig("GPT2BPETokenizer", vocab_file=tok["vocab_file"],
                                                        merge_file=tok["merge_file"]),
                                append_eod=True, log_interval=0))
    return {"jsonl": jsonl, "vocab_file": tok["vocab_file"], "merge_file": tok["merge_file"],
            "data_prefix": prefix + "_text_document"}


def tiny_argv(corpus: dict, *extra: str, **flags) -> list[str]:
    """Flags of a 2-layer, hidden-64 BLOOM-style model on ``corpus`` (``make_tiny_corpus``'s result);
    ``flags`` override (``train_iters=5`` -> ``--train-iters 5``; True -> a bare flag; None or False
    -> dropped), ``extra`` is appended verbatim."""
    base = {
        "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
        "micro_batch_size": 2, "global_batch_size": 8, "train_iters": 10, "lr": 1e-3, "min_lr": 1e-4,
        "lr_decay_style": "cosine", "lr_warmup_iters": 2, "tokenizer_type": "GPT2BPETokenizer",
        "vocab_file": corpus["vocab_file"], "merge_file": corpus["merge_file"], "data_path": corpus["data_prefix"],
        "split": "90,8,2", "log_interval": 1, "eval_interval": 1000, "eval_iters": 0, "hidden_dropout": 0.0,
        "attention_dropout": 0.0, "num_workers": 0, "valid_num_workers": 0, "position_embedding_type": "alibi",
        "embed_layernorm": True, "seed": 1234, "distributed_backend": "gloo",
        "make_vocab_size_divisible_by": 128,  # 512 rows for TP = 1, 2 and 4 alike
    }
    base.update(flags)
    argv = []
    for name, value in base.items():
        if value is None or value is False:
            continue
        argv.append("--" + name.replace("_", "-"))
        if value is not True:
            argv.append(str(value))
    return argv + list(extra)


def write_stand_in_dataset(prefix, num_documents: int = 100) -> str:
    """A real, tiny ``PREFIX.bin/.idx`` (``num_documents`` documents of 8 tokens): a stand-in for a job's
    data where only the flags are checked (the checks read the index header)."""
    with MMapIndexedDatasetBuilder(str(prefix), dtype=np.uint16) as builder:
        for i in range(num_documents):
            builder.add_item(np.arange(i, i + 8) % 500)
            builder.end_document()
        builder.finalize()
    return str(prefix)
