"""A Llama-style run resharded through DeepSpeed's universal checkpoints continues loss for loss:
(2,2,2) -> (1,1,1) -> (4,1,2) within ``run_tolerance`` in fp32 of 20 iterations straight on (2,2,2).

What it shows: the fused QKV laid out per query group and SwiGLU's interleaved (gate, up) rows are merged
exactly by DeepSpeed's dim-0 concatenation of TP shards, and split again at TP 4 (8 heads, 4 key / value
heads: one group per rank), with the untied head and its vocabulary padding kept.
"""

import os

import pytest
import torch

from megatron.testing import run_distributed, tiny_argv
from tests.helpers.training import assert_continues, to_universal, train

ITERS = 20
LLAMA = ("--normalization", "rmsnorm", "--swiglu", "--num-attention-heads", "8", "--num-key-value-heads", "4",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96")


def _argv(corpus, tp, pp, **flags):
    return tiny_argv(corpus, *LLAMA, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                     **dict(dict(train_iters=ITERS, lr_warmup_iters=2, zero_stage=1, position_embedding_type="rope",
                                 embed_layernorm=False), **flags))


@pytest.mark.multiprocess
def test_llama_reshards_222_to_111_to_412(tiny_corpus, tmp_path):
    first, middle = str(tmp_path / "222"), str(tmp_path / "111")
    straight, saved = run_distributed(train, world_size=8, timeout=900, args=([
        _argv(tiny_corpus, 2, 2),
        _argv(tiny_corpus, 2, 2, save=first, save_interval=100, exit_interval=10)],))[-1]
    assert saved["iterations"] == list(range(1, 11))
    reference = straight["losses"]
    assert reference[-1] < reference[0] - 0.1, reference

    to_universal(os.path.join(first, "global_step10"))
    (to_111,) = run_distributed(train, world_size=1, timeout=600, args=([
        _argv(tiny_corpus, 1, 1, load=first, universal_checkpoint=True, save=middle, save_interval=5,
              exit_interval=15)],))[0]
    assert to_111["iterations"] == list(range(11, 16))
    assert_continues(reference[:15], to_111["losses"], "Llama (2,2,2) -> (1,1,1)", dtype=torch.float32)

    to_universal(os.path.join(middle, "global_step15"))
    (to_412,) = run_distributed(train, world_size=8, timeout=900, args=([
        _argv(tiny_corpus, 4, 1, load=middle, universal_checkpoint=True)],))[-1]
    assert to_412["iterations"] == list(range(16, 21))
    assert_continues(reference, to_412["losses"], "Llama (1,1,1) -> (4,1,2)", dtype=torch.float32)
