"""A Llama-style model (RMSNorm, SwiGLU, GQA, no biases, untied head) trains the same on any (TP, PP, DP).

fp32, no dropout: per-iteration losses and grad norms within ``run_tolerance`` (megatron/testing/tolerance.py) of (1,1,1) for
(2,1,1), (1,2,1), (1,1,2) in one 2-process launch and (2,2,2) in one 8-process launch. The untied head
leaves the pipeline without a tied module; with PP 2 the head's weight lives on the last stage only.
"""

import pytest

from megatron.testing import run_distributed, tiny_argv
from tests.helpers.training import assert_same_run, layout, train

ITERS = 10
LLAMA_FLAGS = ("--normalization", "rmsnorm", "--swiglu", "--num-key-value-heads", "2", "--disable-bias-linear",
               "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96")


def _train_then_inspect_stages(rank, world_size, runs, pp_argv):
    """``train(runs)``, then (has a tied module, parameter names) of this rank's stage of ``pp_argv``
    (PP = world size), in the same launch."""
    import torch

    from megatron.arguments import run_config_from_argv
    from megatron.engine.initialize import init_deepspeed_comm
    from megatron.engine.pipeline import build_pipeline_module
    from megatron.parallel.state import ParallelState

    trained = train(rank, world_size, runs)
    torch.set_num_threads(1)
    rc = run_config_from_argv(pp_argv, world_size=world_size)
    state = ParallelState.create(tp=1, pp=world_size)
    try:
        init_deepspeed_comm("gloo")
        module = build_pipeline_module(rc.model, state)
        return trained, (bool(module.tied_modules), sorted(n for n, _ in module.named_parameters()))
    finally:
        state.destroy()


@pytest.fixture(scope="module")
def llama_reference(tiny_corpus):
    argv = tiny_argv(tiny_corpus, *LLAMA_FLAGS, train_iters=ITERS, position_embedding_type="rope",
                     embed_layernorm=False)
    (result,) = run_distributed(train, world_size=1, args=([layout(argv, tp=1, pp=1)],))[0]
    assert len(result["losses"]) == ITERS, result["iterations"]
    assert result["losses"][-1] < result["losses"][0] - 0.05, result["losses"]
    return argv, result


@pytest.mark.multiprocess
def test_llama_two_rank_layouts_match_single_process(llama_reference):
    argv, reference = llama_reference
    runs = [layout(argv, tp=2, pp=1), layout(argv, tp=1, pp=2), layout(argv, tp=1, pp=1)]
    results = run_distributed(_train_then_inspect_stages, world_size=2, args=(runs, layout(argv, tp=1, pp=2)),
                              timeout=600)
    for rank, (per_rank, _) in enumerate(results):
        for (tp, pp, dp), run in zip([(2, 1, 1), (1, 2, 1), (1, 1, 2)], per_rank):
            assert_same_run(reference, run, f"rank {rank} of Llama (tp, pp, dp) = ({tp}, {pp}, {dp})")
    (_, (tied0, first)), (_, (tied1, last)) = results
    assert not tied0 and not tied1
    assert "1.word_embeddings.weight" in first and not any("word_embeddings" in n for n in last)
    # 2 layers: 1 embedding, 3..4 blocks, 6 the final RMSNorm, 7 the untied head
    assert {"7.weight", "6.weight"} <= set(last) and not any(n.startswith(("6.", "7.")) for n in first)


@pytest.mark.multiprocess
def test_llama_3d_layout_matches(llama_reference):
    argv, reference = llama_reference
    results = run_distributed(train, world_size=8, args=([layout(argv, tp=2, pp=2)],), timeout=900)
    for rank, (run,) in enumerate(results):
        assert_same_run(reference, run, f"rank {rank} of Llama (2, 2, 2)")
