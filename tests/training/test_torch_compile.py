"""--torch-compile (each transformer layer compiled) trains to the eager losses at TP=2 x PP=2 and at CP=2 x PP=2
(ring attention) with activation checkpointing, in fp32. One launch, eager then compiled on the same ranks.
Mixture-of-experts layers are compiled by region (norms, attention, shared expert; router, dispatch and experts
eager): at EP=2 they train to the eager losses, grad norms and expert biases, and nothing compiles after the first
iteration."""

import pytest

from megatron.testing import run_distributed
from megatron.testing.tiny_corpus import tiny_argv
from tests.helpers.moe import MOE_FLAGS, VARIANT_FLAGS
from tests.helpers.training import MANY_LAYOUTS, assert_same_run, layout, train

pytestmark = MANY_LAYOUTS

MOE_ITERS = 6


@pytest.mark.multiprocess
def test_compiled_layers_train_to_the_eager_losses_with_tp_pp_and_recompute(tiny_corpus):
    flags = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, train_iters=3, lr_warmup_iters=1,
                 global_batch_size=4, checkpoint_activations=True)
    eager = tiny_argv(tiny_corpus, **flags)
    compiled = tiny_argv(tiny_corpus, "--torch-compile", **flags)
    # context parallelism: the ring kernel (its p2p sends) inside the compiled layers, CP=2 x PP=2
    ring = tiny_argv(tiny_corpus, "--torch-compile", **dict(flags, tensor_model_parallel_size=1, context_parallel_size=2))
    # A stage waits in recv while its neighbour's inductor compiles (first forward, first backward): on 2 busy
    # cores that took over the default 60 s group timeout once in CI, so the groups wait as long as the run may.
    results = run_distributed(train, world_size=4, args=([eager, compiled, ring],), timeout=600, init_timeout_s=600)
    for rank, (eager_run, compiled_run, ring_run) in enumerate(results):
        assert len(compiled_run["losses"]) == 3 and compiled_run["compiled_layers"] == 1, rank
        assert ring_run["compiled_layers"] == 1, rank  # one layer a stage
        # inductor's fused kernels sum in other orders; the ring in others again (one process's computation)
        assert_same_run(eager_run, compiled_run, f"rank {rank}: compiled vs eager")
        assert_same_run(eager_run, ring_run, f"rank {rank}: compiled CP=2 x PP=2 vs eager TP=2 x PP=2")


def train_counting_compilations(rank, world_size, runs):
    """``train_moe``'s records, each with ``compiled_per_step``: after each training iteration, how many graphs
    dynamo has made and how many frames it has compiled (process totals)."""
    import torch._dynamo.utils

    from megatron.training import loop
    from tests.helpers.moe import train_moe

    counts = []
    step = loop.Trainer.train_step

    def counted_step(self):
        record = step(self)
        counters = torch._dynamo.utils.counters
        counts.append((counters["stats"]["unique_graphs"], counters["frames"]["ok"]))
        return record

    loop.Trainer.train_step = counted_step
    out = []
    for argv in runs:
        counts.clear()
        (record,) = train_moe(rank, world_size, [argv])
        out.append(dict(record, compiled_per_step=list(counts)))
    return out


@pytest.mark.multiprocess
def test_moe_layers_compile_by_region_and_train_to_the_eager_run(tiny_corpus):
    """EP=2 over DP=2, the MoE variant eager then compiled: its dense first layer compiled whole, its MoE layer by
    region (the norms, the attention, and the shared expert of its SwiGLU experts; the router, the dispatch with
    capacity dropping and the experts eager). It trains as the eager run, and no graph is made after iteration 1."""
    argv = tiny_argv(tiny_corpus, *MOE_FLAGS, *VARIANT_FLAGS, "--expert-model-parallel-size", "2",
                     train_iters=MOE_ITERS, hidden_size=32, seq_length=16, lr=3e-3)
    results = run_distributed(train_counting_compilations, world_size=2, args=([argv, layout(argv, "--torch-compile")],),
                              timeout=600, init_timeout_s=600)
    for rank, (eager, compiled) in enumerate(results):
        # the dense layer, and the MoE layer's 4 regions with its shared expert
        assert (eager["compiled_layers"], compiled["compiled_layers"]) == (0, 5)
        assert_same_run(eager, compiled, f"rank {rank}: compiled vs eager")
        assert compiled["expert_bias"] and compiled["expert_bias"].keys() == eager["expert_bias"].keys()
        for name, bias in compiled["expert_bias"].items():
            assert bias == pytest.approx(eager["expert_bias"][name], abs=1e-6), (rank, name)
        per_step = compiled["compiled_per_step"]
        assert len(per_step) == MOE_ITERS and per_step[0][0] > 0, (rank, per_step)
        assert all(counts == per_step[0] for counts in per_step), f"rank {rank}: compiled again {per_step}"
        assert all(counts == (0, 0) for counts in eager["compiled_per_step"]), (rank, eager["compiled_per_step"])


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


def test_an_moe_layer_is_compiled_by_region():
    """The dense parts of an MoE layer are compiled, the layer itself, its router and its experts are not; a dense
    layer is compiled whole."""
    from megatron.config.moe import MoEConfig
    from megatron.model import GPTModel
    from megatron.model.compile import compile_transformer_layers
    from megatron.parallel.state import ParallelState
    from tests.helpers.model import tiny_config

    moe = MoEConfig(num_experts=4, layer_pattern=(False, True), shared_expert_intermediate_size=32).validate(2)
    model = GPTModel(tiny_config(moe=moe), ParallelState.single())
    assert compile_transformer_layers(model) == 2
    compiled = {name for name, m in model.named_modules() if m._compiled_call_impl is not None}
    assert compiled == {"layers.0"} | {f"layers.1.{region}" for region in (
        "input_layernorm", "self_attention", "post_attention_layernorm", "mlp.shared_expert")}, sorted(compiled)
