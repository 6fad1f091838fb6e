"""A tiny synthetic corpus for tests and benchmarks: text, a trained byte-level BPE, a .bin/.idx.

Deterministic from ``seed``; a few hundred documents of pseudo-sentences, built in about a second.
"""

from __future__ import annotations

import json
import os
import random


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
    from megatron.data.preprocess import PreprocessConfig, TokenizerSpec, preprocess
    from megatron.data.tokenizers import train_bpe_tokenizer

    os.makedirs(out_dir, exist_ok=True)
    docs = make_text(num_docs, seed)
    jsonl = os.path.join(out_dir, "corpus.jsonl")
    with open(jsonl, "w") as f:
        for text in docs:
            f.write(json.dumps({"text": text}) + "\n")
    tok = train_bpe_tokenizer(docs, vocab_size, os.path.join(out_dir, "tokenizer"))
    prefix = os.path.join(out_dir, "corpus")
    preprocess(PreprocessConfig(input=jsonl, output_prefix=prefix,
                                tokenizer=TokenizerSpec("GPT2BPETokenizer", vocab_file=tok["vocab_file"],
                                                        merge_file=tok["merge_file"]),
                                append_eod=True, log_interval=0))
    return {"jsonl": jsonl, "vocab_file": tok["vocab_file"], "merge_file": tok["merge_file"],
            "data_prefix": prefix + "_text_document"}
