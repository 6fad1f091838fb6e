"""Fixtures for end-to-end training tests: a tiny synthetic corpus and the flags of a tiny model."""

import pytest

from megatron.testing.corpus import make_tiny_corpus


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    return make_tiny_corpus(str(tmp_path_factory.mktemp("tiny_corpus")))


def tiny_argv(corpus: dict, *extra: str, **flags) -> list[str]:
    """Flags of a 2-layer, hidden-64 BLOOM-style model on the tiny corpus; ``flags`` override
    (``train_iters=5`` -> ``--train-iters 5``; True -> a bare flag)."""
    base = {
        "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
        "micro_batch_size": 2, "global_batch_size": 8, "train_iters": 10, "lr": 1e-3, "min_lr": 1e-4,
        "lr_decay_style": "cosine", "lr_warmup_iters": 2, "tokenizer_type": "GPT2BPETokenizer",
        "vocab_file": corpus["vocab_file"], "merge_file": corpus["merge_file"], "data_path": corpus["data_prefix"],
        "split": "90,8,2", "log_interval": 1, "eval_interval": 1000, "eval_iters": 0, "hidden_dropout": 0.0,
        "attention_dropout": 0.0, "num_workers": 0, "valid_num_workers": 0, "position_embedding_type": "alibi",
        "embed_layernorm": True, "seed": 1234, "distributed_backend": "gloo", "make_vocab_size_divisible_by": 128,  # 512 rows for TP = 1, 2 and 4 alike
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
