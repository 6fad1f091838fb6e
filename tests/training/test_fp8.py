"""FP8 training end to end (--fp8-format hybrid, bf16 runs, a tiny Llama-style model: RMSNorm, SwiGLU, rotary,
grouped-query attention, no biases, untied output layer):

- Each recipe (tensorwise, delayed with a 4-iteration max history, blockwise, mxfp8) trains 20 iterations: every
  loss finite, within BAND of the bf16 run's at every iteration from the third, and not equal to it (FP8 ran).
  BAND: FP8 rounds each GEMM operand to 3 mantissa bits (e4m3: up to 2^-4 relative per element, e5m2 gradients
  2^-3); over sums of 64 to 256 terms those roundings average out, and the loss averages 256 tokens' losses, so a
  percent is a generous band for 20 steps (measured here: at most 0.04%).
- Delayed scaling saved after 10 iterations and resumed to 20 repeats the straight run bit for bit (the amax
  history and scales are in the checkpoint).
- TP=2 x PP=2 x DP=2 (8 processes) with delayed and with tensorwise scaling tracks the one-process FP8 run
  (``fp8_run_tolerance``: the layouts' bf16 roundings flip FP8 roundings; e5m2 the coarser type).
- MoE (4 experts, top 2) with FP8 experts at EP=2 (2 processes) tracks the one-process MoE FP8 run.
- The delayed run's universal checkpoint keeps every layer's amax history and scales (equal to the layer files'),
  and resumed at TP=2 it tracks the straight run.
- An FP8 run's checkpoint exports to transformers as a bf16 model with the same tensors as a bf16 run's export.
"""

import json
import math
import os

import pytest
import torch

from megatron.testing import run_distributed, tiny_argv
from megatron.testing.tolerance import fp8_run_tolerance
from tests.helpers.training import MANY_LAYOUTS, TINY_LAYERS, TINY_WIDTH, assert_continues, layout, train

pytestmark = MANY_LAYOUTS

ITERS = 20
BAND = 0.01
LLAMA = ("--normalization", "rmsnorm", "--swiglu", "--num-attention-heads", "8", "--num-key-value-heads", "4",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96",
         "--position-embedding-type", "rope")
FP8 = ("--fp8-format", "hybrid")
RECIPES = {"tensorwise": ("--fp8-recipe", "tensorwise"),
           "delayed": ("--fp8-recipe", "delayed", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"),
           "blockwise": ("--fp8-recipe", "blockwise"),
           "mxfp8": ("--fp8-recipe", "mxfp8")}
MOE = ("--num-experts", "4", "--moe-router-topk", "2")
MOE_ITERS = 6
LAYOUT_ITERS = 10  # the 8-process runs stop here (--exit-interval): the schedule is the 20-iteration one
SHORT = 4  # the compositions with other features: 4 iterations each
COMPOSITIONS = {"ZB-H1, PP=2": ("--pipeline-model-parallel-size", "2", "--enable-zbh1-pipeline",
                                "--enable-zbh1-exact-semantics"),
                "CP=2 (ring attention)": ("--context-parallel-size", "2"),
                "Ulysses SP=2": ("--ds-sequence-parallel-size", "2"),
                "TP=2 with sequence parallelism": ("--tensor-model-parallel-size", "2", "--sequence-parallel")}


@pytest.fixture(scope="module")
def base(tiny_corpus):
    return tiny_argv(tiny_corpus, "--bf16", *LLAMA, train_iters=ITERS, embed_layernorm=False,
                     position_embedding_type=None)


@pytest.fixture(scope="module")
def moe_argv(tiny_corpus):
    return tiny_argv(tiny_corpus, "--bf16", *LLAMA, *MOE, *FP8, "--fp8-recipe", "tensorwise", train_iters=MOE_ITERS,
                     embed_layernorm=False, position_embedding_type=None)


def _short(base):
    argv = list(base) + list(FP8) + list(RECIPES["tensorwise"])
    return argv[:argv.index("--train-iters") + 1] + [str(SHORT)] + argv[argv.index("--train-iters") + 2:]


def _assert_tracks(reference, other, label):
    assert len(other) == len(reference), label
    for it, (a, b) in enumerate(zip(reference, other, strict=True), start=1):
        rel = fp8_run_tolerance(torch.bfloat16, torch.float8_e5m2, TINY_LAYERS, TINY_WIDTH, it)
        assert abs(a - b) <= rel * abs(a), f"{label}: iteration {it}: loss {b} vs one process {a} ({rel:.2g})"


@pytest.fixture(scope="module")
def one_process(base, moe_argv, tmp_path_factory):
    """One launch: bf16, each recipe, the delayed run saved at 10 and resumed, and the MoE reference."""
    save = str(tmp_path_factory.mktemp("fp8_checkpoints"))
    runs = {"bf16": base}
    runs.update({name: base + list(FP8) + list(flags) for name, flags in RECIPES.items()})
    checkpoint = ["--save", save, "--save-interval", "100"]
    runs["delayed: saved at 10"] = runs["delayed"] + checkpoint + ["--exit-interval", "10"]
    runs["delayed: resumed to 20"] = runs["delayed"] + checkpoint + ["--load", save]
    runs["moe"] = moe_argv
    short = _short(base)
    runs["short"], runs["short, --torch-compile"] = short, short + ["--torch-compile"]
    records = run_distributed(train, world_size=1, args=(list(runs.values()),))[0]
    return dict(zip(runs, records, strict=True)), save


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_each_recipe_trains_near_bf16_and_not_as_bf16(one_process, recipe):
    records, _ = one_process
    bf16, fp8 = records["bf16"]["losses"], records[recipe]["losses"]
    assert len(fp8) == ITERS and all(math.isfinite(loss) for loss in fp8), fp8
    for it, (a, b) in enumerate(zip(bf16, fp8, strict=True), start=1):
        if it >= 3:
            assert abs(b - a) <= BAND * a, f"{recipe}: iteration {it}: loss {b} vs bf16 {a}"
    assert fp8 != bf16, f"{recipe}: the losses equal bf16's: FP8 did not run"
    assert fp8[-1] < fp8[0] - 0.3, f"{recipe} did not learn: {fp8}"


def test_delayed_scaling_resumes_bit_for_bit(one_process):
    records, _ = one_process
    assert records["delayed: saved at 10"]["iteration"] == 10
    assert_continues(records["delayed"]["losses"], records["delayed: resumed to 20"]["losses"], "delayed resume")


def test_fp8_checkpoint_exports_as_bf16(one_process, tmp_path):
    from safetensors import safe_open

    from tools.convert_checkpoint import to_hf

    _, save = one_process
    assert to_hf.main(["--load", save, "--output-dir", str(tmp_path / "hf"), "--no-tokenizer"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        dtypes = {f.get_tensor(name).dtype for name in names}
    assert dtypes == {torch.bfloat16}, (dtypes, config.get("torch_dtype"), config.get("dtype"))
    assert not any("fp8" in name or "amax" in name for name in names), names
    assert config["architectures"] == ["LlamaForCausalLM"] and "model.layers.1.mlp.down_proj.weight" in names


@pytest.fixture(scope="module")
def eight_processes(base):
    runs = [layout(base, *FP8, *RECIPES[recipe], "--exit-interval", LAYOUT_ITERS, tp=2, pp=2)
            for recipe in ("delayed", "tensorwise")]
    return dict(zip(("delayed", "tensorwise"), run_distributed(train, world_size=8, args=(runs,))[0], strict=True))


@pytest.mark.multiprocess
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_at_tp2_pp2_dp2_tracks_one_process(one_process, eight_processes, recipe):
    reference, other = one_process[0][recipe], eight_processes[recipe]
    assert other["iteration"] == LAYOUT_ITERS and other["dp_size"] == 2
    _assert_tracks(reference["losses"][:LAYOUT_ITERS], other["losses"], recipe)


@pytest.fixture(scope="module")
def two_processes(one_process, base, moe_argv):
    """One launch: MoE at EP=2, and the delayed run's universal checkpoint (10 iterations) resumed at TP=2."""
    from tests.helpers.training import to_universal

    _, save = one_process
    universal = to_universal(os.path.join(save, "global_step10"))
    runs = [layout(moe_argv, "--expert-model-parallel-size", 2),
            layout(base, *FP8, *RECIPES["delayed"], "--load", save, "--universal-checkpoint", tp=2)]
    return universal, run_distributed(train, world_size=2, args=(runs,))[0]


@pytest.mark.multiprocess
def test_moe_fp8_at_ep2_tracks_one_process(one_process, two_processes):
    reference, other = one_process[0]["moe"], two_processes[1][0]
    assert len(other["losses"]) == MOE_ITERS and all(math.isfinite(loss) for loss in other["losses"])
    _assert_tracks(reference["losses"], other["losses"], "EP=2")


@pytest.mark.multiprocess
def test_delayed_scaling_state_travels_in_universal_checkpoints(one_process, two_processes):
    from megatron.checkpoint.safe_load import safe_load
    from megatron.checkpoint.universal.fp8_state import FP8_STATE_FILE

    records, save = one_process
    universal, (_, resumed) = two_processes
    kept = safe_load(os.path.join(universal, FP8_STATE_FILE))
    layer = safe_load(os.path.join(save, "global_step10", "layer_03-model_00-model_states.pt"))  # layer 0
    saved = {key: t for key, t in layer.items() if ".fp8." in key}
    assert len(kept) == 2 * len(saved) == 16  # 2 layers x 4 linear layers x (history, scales)
    for key, t in saved.items():
        assert torch.equal(kept["layers.0." + key], t), key
    assert kept["layers.0.mlp.dense_h_to_4h.fp8.amax_history"].count_nonzero() == 12  # 4 iterations x 3 amaxes
    assert resumed["iterations"] == list(range(11, ITERS + 1))
    for it, a, b in zip(resumed["iterations"], records["delayed"]["losses"][10:], resumed["losses"], strict=True):
        rel = fp8_run_tolerance(torch.bfloat16, torch.float8_e5m2, TINY_LAYERS, TINY_WIDTH, it)
        assert abs(a - b) <= rel * abs(a), f"universal resume at TP=2: iteration {it}: loss {b} vs {a} ({rel:.2g})"


@pytest.fixture(scope="module")
def compositions(base):
    return run_distributed(train, world_size=2, args=([_short(base) + list(flags)
                                                      for flags in COMPOSITIONS.values()],))[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("index", range(len(COMPOSITIONS)), ids=list(COMPOSITIONS))
def test_fp8_composes_with(one_process, compositions, index):
    """FP8 (tensorwise) with ZB-H1 (its weight gradients deferred through fp8_linear), context parallelism,
    Ulysses and Megatron sequence parallelism, each on 2 processes, tracks the one-process FP8 run."""
    _assert_tracks(one_process[0]["short"]["losses"], compositions[index]["losses"], list(COMPOSITIONS)[index])


def test_fp8_with_torch_compile_tracks_eager(one_process):
    records, _ = one_process
    compiled = records["short, --torch-compile"]
    assert compiled["compiled_layers"] == 2
    _assert_tracks(records["short"]["losses"], compiled["losses"], "--torch-compile")

