"""--recompute-modules (Megatron-LM's selective recomputation by module): each module gives the loss and gradients
of the run without recomputation, frees what the planner says it frees (measured: the bytes a layer's forward
leaves alive for backward), and --dry-run reports the smaller activation memory. The flags follow Megatron-LM's
rules (--moe-layer-recompute its deprecated spelling). Training runs: tests/training/test_moe.py (the MoE modules,
EP = 2 with the layer's all-to-alls replayed), tests/training/test_mla.py (mla_up_proj and layernorm at TP = 2 +
SP and under ZB-H1), tests/model/test_selective_recompute.py (dense)."""

import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron.config.fp8 import FP8Config
from megatron.config.mla import MLAConfig
from megatron.config.moe import MoEConfig
from megatron.model import GPTModel
from megatron.model.transformer import TransformerLayer
from megatron.parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker
from megatron.parallel.state import ParallelState
from megatron.planner.candidate import Layout
from megatron.planner.memory import (
    fp8_kept_savings,
    layer_activation_bytes,
    layer_kept_bytes,
    recompute_saved_bytes,
)
from megatron.planner.specs import model_shape_of
from megatron.testing.tiny_corpus import tiny_argv
from megatron.testing.tolerance import tolerance
from tests.helpers.arguments import tiny_config_argv
from tests.helpers.model import tiny_config

SEQ, BATCH = 32, 2
MLA = MLAConfig(q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12)


def _moe(**overrides) -> MoEConfig:
    fields = dict(num_experts=4, layer_pattern=(False, True), router_topk=2, aux_loss_coeff=0.01, z_loss_coeff=0.001,
                  router_enable_expert_bias=True, shared_expert_intermediate_size=32)
    fields.update(overrides)
    return MoEConfig(**fields).validate(2)


# Layer 0 dense, layer 1 MoE (with a shared expert); SwiGLU with biases, and GeLU without (MLA's).
MODELS = {
    "moe": dict(position_embedding_type="rotary", swiglu=True, moe=_moe()),
    "mla moe": dict(position_embedding_type="rotary", mla=MLA, moe=_moe(), add_bias_linear=False),
    "mla moe rmsnorm": dict(position_embedding_type="rotary", mla=MLA, moe=_moe(), add_bias_linear=False,
                            normalization="rmsnorm", swiglu=True),
    # FP8 GEMMs (delayed scaling: a replay records the same amaxes into the iteration's max)
    "mla moe fp8": dict(position_embedding_type="rotary", mla=MLA, moe=_moe(), add_bias_linear=False, swiglu=True,
                        fp8=FP8Config(fp8_format="hybrid", fp8_recipe="delayed")),
}
MODULES = {"moe": ("layernorm", "mlp", "moe", "moe_act", "shared_experts"),
           "mla moe": ("layernorm", "mlp", "moe", "moe_act", "shared_experts", "mla_up_proj"),
           "mla moe rmsnorm": ("layernorm", "mla_up_proj"),
           "mla moe fp8": ("layernorm", "mlp", "moe_act", "shared_experts", "mla_up_proj")}


def _tracker() -> RNGStatesTracker:
    tracker = RNGStatesTracker("cpu")
    tracker.add(MODEL_PARALLEL_RNG, 99)
    return tracker


def _loss_and_grads(model: str, modules: tuple, core_attention: bool = False):
    torch.manual_seed(0)
    config = tiny_config(seq_length=SEQ, hidden_dropout=0.1, attention_dropout=0.1, recompute_modules=modules,
                         recompute_core_attention=core_attention, **MODELS[model])
    gpt = GPTModel(config, ParallelState.single(), rng_tracker=_tracker()).train()
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    loss = gpt(ids, labels=ids, loss_mask=torch.ones(BATCH, SEQ))
    loss.backward()
    biases = {n: b.clone() for n, b in gpt.named_buffers() if n.endswith("tokens_per_expert")}
    return loss.item(), {n: p.grad.clone() for n, p in gpt.named_parameters()}, biases


@pytest.mark.parametrize("model,modules,core", [(model, (m,), False) for model in MODELS for m in MODULES[model]
                                                 if "fp8" not in model]
                         + [(model, MODULES[model], True) for model in MODELS])
def test_each_module_gives_the_loss_and_gradients_of_no_recomputation(model, modules, core):
    """fp32, dropout on (the recomputed parts draw no random numbers; the attention core's dropout is replayed),
    each module alone, then all of them with core_attn (whose checkpoint holds the query, key and value that
    mla_up_proj frees and rebuilds, after the input norm's output they are rebuilt from). The rebuilt outputs are
    the forward's values bit for bit; the gradients are the same products, but a recomputed part's input gradient
    is summed before it joins the other contributions (an RMSNorm's two uses of its input and the residual), hence
    a tolerance (of one layer's depth) rather than equality."""
    loss, grads, counts = _loss_and_grads(model, (), core)
    loss_r, grads_r, counts_r = _loss_and_grads(model, modules, core)
    assert loss_r == loss, modules  # the forward computes the same numbers
    assert set(grads_r) == set(grads)
    for name, grad in grads.items():
        diff = (grads_r[name] - grad).abs().max().item()
        assert diff <= tolerance(torch.float32, 8, 64, grad.abs().max().item()), (modules, name, diff)
    # the replay of a recomputed MoE layer counts no choices (the expert bias moves as without recomputation)
    assert all(torch.equal(counts_r[n], counts[n]) for n in counts) and counts, modules


class _LiveStorages(TorchDispatchMode):
    """Every storage the ops create while it is on (not those of ``existing``); ``live_bytes()``: the bytes of those
    still alive (a freed output's storage counts its size, 0)."""

    def __init__(self, existing):
        super().__init__()
        self.old = {StorageWeakRef(t.untyped_storage()).cdata for t in existing}
        self.made = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.old:
                    self.made.setdefault(ref.cdata, ref)
        return out

    def live_bytes(self) -> int:
        gc.collect()
        return sum(torch.UntypedStorage._new_with_weak_ptr(cdata).nbytes() for cdata, ref in self.made.items()
                   if not ref.expired())


def _kept_bytes(model: str, layer_number: int, modules: tuple, **overrides) -> int:
    """The bytes one training forward of layer ``layer_number`` leaves alive (what it keeps for backward and its
    output), its input and parameters aside."""
    torch.manual_seed(0)
    config = tiny_config(seq_length=SEQ, recompute_modules=modules, **{**MODELS[model], **overrides})
    layer = TransformerLayer(config, layer_number=layer_number, rng_tracker=_tracker()).train()
    x = torch.randn(SEQ, BATCH, config.hidden_size, requires_grad=True)
    with _LiveStorages([x, *layer.parameters()]) as live:
        y = layer(x)
    kept = live.live_bytes()
    del y
    return kept


@pytest.mark.parametrize("model", ["moe", "mla moe"])
def test_what_each_module_frees_is_what_the_planner_counts(model):
    """Measured: the bytes a layer's forward leaves alive, without and with each module recomputed (the dense layer
    0 and the MoE layer 1), against ``recompute_saved_bytes`` for the same shape in fp32: within 1% (moe's is
    ``layer_activation_bytes``' MoE-layer estimate). The CPU's attention core stores its scores (the math kernel:
    the planner's store_attention_scores)."""
    config = tiny_config(seq_length=SEQ, **MODELS[model])
    shape = model_shape_of(config)
    for layer_number in (0, 1):
        plain = _kept_bytes(model, layer_number, ())
        moe_layer = layer_number == 1
        for module in MODULES[model]:
            layout = Layout(1, 1, 1, BATCH, recompute=False, precision="fp32", recompute_modules=(module,))
            predicted = recompute_saved_bytes(shape, layout, SEQ, 4, moe_layer=moe_layer)[module]
            freed = plain - _kept_bytes(model, layer_number, (module,))
            assert abs(freed - predicted) <= 0.01 * max(predicted, 1), (model, layer_number, module, freed, predicted)
            if (module in ("mlp",)) != moe_layer:
                assert freed > 0, (model, layer_number, module)
        # the whole layer: the planner's per-layer figure drops by the module's
        layout = Layout(1, 1, 1, BATCH, recompute=False, precision="fp32")
        whole = layer_activation_bytes(shape, layout, SEQ, 4, moe_layer=moe_layer)
        fewer = layer_kept_bytes(shape, Layout(1, 1, 1, BATCH, recompute=False, precision="fp32",
                                                     recompute_modules=MODULES[model]), SEQ, 4, moe_layer=moe_layer)
        assert fewer < whole


def test_what_fp8_layers_keep_less_is_what_the_planner_counts():
    """Measured: the bytes a layer's forward leaves alive without FP8 and with FP8 GEMMs (tensorwise; the dense layer
    0 and the MoE layer 1 with a shared expert; SwiGLU without biases, fp32), whose linear layers keep their inputs
    as 1-byte FP8 operands, or beside a tensor kept anyway (the attention kernel's output, the router's input): the
    difference against ``fp8_kept_savings`` within 1%."""
    fp8 = FP8Config(fp8_format="e4m3", fp8_recipe="tensorwise")
    config = tiny_config(seq_length=SEQ, fp8=fp8, **{**MODELS["moe"], "add_bias_linear": False})
    shape = model_shape_of(config)
    # SDPA's fused CPU kernel (no dropout here): no scores stored, the context kept as its output
    layout = Layout(1, 1, 1, BATCH, recompute=False, precision="fp32", store_attention_scores=False)
    for layer_number in (0, 1):
        plain = _kept_bytes("moe", layer_number, (), add_bias_linear=False)
        with_fp8 = _kept_bytes("moe", layer_number, (), add_bias_linear=False, fp8=fp8)
        predicted = fp8_kept_savings(shape, layout, SEQ, 4, moe_layer=layer_number == 1)
        assert abs(plain - with_fp8 - predicted) <= 0.01 * predicted, (layer_number, plain - with_fp8, predicted)


def _dry_run(files, *extra):
    """The --dry-run report of a tiny DeepSeek-shaped job (MLA, MoE with a shared expert), and the planner's
    activation bytes of its busiest stage, unrounded (the report's GiB round a tiny model's to 0)."""
    from megatron.arguments.check import check_argv
    from megatron.dry_run.estimate import model_shape, planner_layout
    from megatron.dry_run.report import build_report
    from megatron.planner import estimate_memory

    argv = tiny_config_argv(files, num_layers=4) + [
        "--bf16", "--dry-run", "--world-size", "1", "--swiglu", "--num-experts", "4", "--moe-shared-expert-"
        "intermediate-size", "32", "--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16",
        "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--position-embedding-type",
        "rope", "--disable-bias-linear", *extra]
    report = build_report(argv)
    assert report["ok"], report["problems"]
    rc = check_argv(argv).run_config
    memory = estimate_memory(model_shape(rc), planner_layout(rc, [4]), rc.data.seq_length,
                             rc.batch.global_batch_size)
    return report, memory.per_stage[memory.peak_stage]["activations"]


def test_dry_run_reports_the_smaller_activation_memory(tokenizer_files):
    """--dry-run: the planner's activations drop with --recompute-modules (by what recompute_saved_bytes counts),
    and the memory line names the recomputed modules."""
    from megatron.dry_run.text import render

    modules = ["mla_up_proj", "moe_act", "layernorm"]
    plain, before = _dry_run(tokenizer_files)
    recomputed, after = _dry_run(tokenizer_files, "--recompute-granularity", "selective", "--recompute-modules",
                                 *modules)
    assert plain["memory"]["recompute_modules"] == [] and recomputed["memory"]["recompute_modules"] == modules
    assert after < before, (after, before)
    assert any("recomputed: mla_up_proj moe_act layernorm" in line for line in render(recomputed).splitlines())


def test_megatron_lm_recompute_modules_rules(tiny_corpus):
    from megatron.arguments import run_config_from_argv

    def config(*extra):
        return run_config_from_argv(tiny_argv(tiny_corpus, *extra), world_size=1)

    moe = ("--num-experts", "4", "--moe-shared-expert-intermediate-size", "32")
    selective = ("--recompute-granularity", "selective", "--recompute-modules")
    rc = config(*moe, *selective, "moe_act", "layernorm", "shared_experts")
    assert rc.model.recompute_modules == ("moe_act", "layernorm", "shared_experts")
    assert not rc.model.recompute_core_attention  # core_attn is the default only when no list is given
    default = config("--recompute-granularity", "selective")
    assert default.model.recompute_core_attention and default.model.recompute_modules == ()
    # --moe-layer-recompute: Megatron-LM's deprecated spelling, moe added to the (default) modules
    old = config(*moe, "--moe-layer-recompute")
    assert old.model.recompute_modules == ("moe",) and old.model.recompute_core_attention
    assert [w for w in old.startup_warnings if "--moe-layer-recompute is deprecated" in w]
    with pytest.raises(ValueError, match="--moe-layer-recompute"):
        config(*moe, "--moe-layer-recompute", "--recompute-granularity", "full")
    for modules, match in ((("moe",), "needs --num-experts"), (("moe_act",), "needs --num-experts"),
                           (("mla_up_proj",), "needs --multi-latent-attention"), (("gdn_norm_out",), "is not one of")):
        with pytest.raises(ValueError, match=match):
            config(*selective, *modules)
    with pytest.raises(ValueError, match="--moe-shared-expert-overlap"):
        config(*moe, "--moe-shared-expert-overlap", *selective, "shared_experts")
    ignored = config("--recompute-modules", "mlp")  # without selective granularity: nothing recomputed, said so
    assert ignored.model.recompute_modules == () and not ignored.model.recompute_core_attention
    assert [w for w in ignored.startup_warnings if "--recompute-modules mlp has no effect" in w]
    full = config("--recompute-granularity", "full", "--recompute-modules", "mlp")  # full recomputes whole layers
    assert full.training.checkpoint_activations and full.model.recompute_modules == ()
