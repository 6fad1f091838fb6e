"""--torch-compile (each transformer layer compiled) trains to the eager losses at TP=2 x PP=2 with activation
checkpointing, in fp32. One launch, eager then compiled on the same ranks."""

import pytest

from megatron.testing import run_distributed
from megatron.testing.tiny_corpus import tiny_argv
from tests.helpers.training import assert_same_run, train


@pytest.mark.multiprocess
def test_compiled_layers_train_to_the_eager_losses_with_tp_pp_and_recompute(tiny_corpus):
    flags = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, train_iters=3, lr_warmup_iters=1,
                 global_batch_size=4, checkpoint_activations=True)
    eager = tiny_argv(tiny_corpus, **flags)
    compiled = tiny_argv(tiny_corpus, "--torch-compile", **flags)
    results = run_distributed(train, world_size=4, args=([eager, compiled],), timeout=600)
    eager_run, compiled_run = results[0]
    assert len(compiled_run["losses"]) == 3
    assert_same_run(eager_run, compiled_run, "compiled vs eager")  # inductor's fused kernels sum in other orders


def test_every_transformer_layer_is_compiled_in_place_and_a_missing_compiler_is_named(monkeypatch):
    from megatron.engine.cpu import check_cpu_compiler
    from megatron.model import GPTModel
    from megatron.model.compile import compile_transformer_layers
    from megatron.parallel.state import ParallelState
    from tests.helpers.model import tiny_config

    model = GPTModel(tiny_config(), ParallelState.single())
    names = [n for n, _ in model.named_parameters()]
    assert compile_transformer_layers(model) == 2
    assert all(layer._compiled_call_impl is not None for layer in model.layers)
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints keep their keys
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ValueError, match="needs a C\\+\\+ compiler.*g\\+\\+, c\\+\\+, clang\\+\\+"):
        check_cpu_compiler()
