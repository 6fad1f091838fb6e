"""Universal checkpoints between ZeRO-3 / ZeRO-2 (DeepSpeed's model engine, GPTModel's names) and
3D (the pipeline engine, its layer-indexed names), both ways.

ZeRO-3 at TP=1 x DP=4 and 3D at TP=2 x PP=2 x DP=2 each train 10 iterations straight, saving at 5 (the
same run: saving does not change it, test_checkpoints.py). Each step-5 checkpoint, converted by
ds_to_universal.py --target-engine for the other engine, resumes there at iteration 6 with its Adam
moments, step count, schedule and data position: the continued losses equal, within ``run_tolerance`` in fp32, both
the source's own iterations 6-10 (the run continuing) and the target layout's straight run (the two
layouts train alike, test_zero_sharding.py / test_equivalence.py). A run that loads and saves at once
saves exactly the weights the source saved (merged to TP = 1 by megatron.checkpoint.single_process). ZeRO-2 at
TP=2 x DP=2 the same way: to 3D, and from the 3D checkpoint converted for ZeRO-3 (one conversion in
GPTModel's names serves both stages), which ZeRO-3 at TP=2 x DP=2 loads too; a Llama-style model
(untied head) both ways between ZeRO-3 and 3D. Wrong-engine and stale conversions are refused by name,
the renamed files carry checksums, a crafted or incomplete folder is refused.
Tiny model (hidden 32, 2 layers, seq 16; the Llama-style one hidden 64): one 4-process and one 8-process launch,
then one 4-process, every run of the module in them.
"""

import json
import os
import shutil

import pytest
import torch

from megatron.testing import run_distributed, tiny_argv
from tests.helpers.training import assert_continues, to_universal, train

ZERO3 = ["--zero-stage", "3"]  # TP = 1, DP = 4 on 4 ranks
ZERO2 = ["--zero-stage", "2", "--tensor-model-parallel-size", "2"]  # TP = 2, DP = 2
THREE_D = ["--zero-stage", "1", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def _argv(corpus, *extra, **flags):
    # --lr-decay-iters fixes the schedule, so a run of --train-iters 5 (load, then save at once) keeps it
    base = dict(train_iters=10, lr_decay_iters=10, hidden_size=32, seq_length=16)
    return tiny_argv(corpus, *extra, **dict(base, **flags))


def _to_universal(ckpt, engine, out_root):
    """CKPT/global_step5 converted for ``engine`` into OUT_ROOT/global_step5_universal (OUT_ROOT/latest_universal)."""
    to_universal(os.path.join(ckpt, "global_step5"), os.path.join(out_root, "global_step5_universal"),
                 "--target-engine", engine)


LLAMA = ("--normalization", "rmsnorm", "--swiglu", "--num-attention-heads", "8", "--num-key-value-heads", "4",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96",
         "--position-embedding-type", "rope")


def _llama_argv(tiny_corpus, *extra, **flags):
    return _argv(tiny_corpus, *LLAMA, *extra, hidden_size=64, embed_layernorm=False, **flags)


@pytest.fixture(scope="module")
def reshaped(tiny_corpus, tmp_path_factory):
    """Every run of the module, in three launches (4, 8 and 4 processes): the BLOOM-style ones, and the Llama-style
    ones ("llama_*": ZeRO-3 -> 3D -> ZeRO-3)."""
    root = tmp_path_factory.mktemp("uni")
    d = {name: str(root / name) for name in ("z3", "z2", "d3", "z3_for_3d", "z2_for_3d", "d3_for_z3", "z3_loaded",
                                             "d3_loaded", "z3_for_model", "llama_z3", "llama_d3", "llama_z3_for_3d",
                                             "llama_d3_for_z3")}
    z3, z2, llama_z3 = run_distributed(train, world_size=4, timeout=600, args=(
        [_argv(tiny_corpus, *ZERO3, save=d["z3"], save_interval=5),
         _argv(tiny_corpus, *ZERO2, save=d["z2"], save_interval=5),
         _llama_argv(tiny_corpus, *ZERO3, save=d["llama_z3"], save_interval=5)],))[0]
    _to_universal(d["z3"], "pipeline", d["z3_for_3d"])
    _to_universal(d["z2"], "pipeline", d["z2_for_3d"])
    _to_universal(d["llama_z3"], "pipeline", d["llama_z3_for_3d"])
    from_z3 = dict(load=d["z3_for_3d"], universal_checkpoint=True)
    d3, d3_resumed, d3_loaded, d3_from_z2, llama_d3, llama_d3_resumed = run_distributed(
        train, world_size=8, timeout=900, args=(
            [_argv(tiny_corpus, *THREE_D, save=d["d3"], save_interval=5),
             _argv(tiny_corpus, *THREE_D, **from_z3),
             _argv(tiny_corpus, *THREE_D, **from_z3, train_iters=5, save=d["d3_loaded"], save_interval=100),
             _argv(tiny_corpus, *THREE_D, load=d["z2_for_3d"], universal_checkpoint=True),
             _llama_argv(tiny_corpus, *THREE_D, save=d["llama_d3"], save_interval=5),
             _llama_argv(tiny_corpus, *THREE_D, load=d["llama_z3_for_3d"], universal_checkpoint=True)],))[-1]
    _to_universal(d["d3"], "model", d["d3_for_z3"])
    _to_universal(d["z3"], "model", d["z3_for_model"])  # the saving run's own engine, for ZeRO-2 and 3 at any TP
    _to_universal(d["llama_d3"], "model", d["llama_d3_for_z3"])
    from_d3 = dict(load=d["d3_for_z3"], universal_checkpoint=True)
    from_z3 = dict(load=d["z3_for_model"], universal_checkpoint=True)
    tp2 = ["--tensor-model-parallel-size", "2"]
    z3_resumed, z3_loaded, z2_from_d3, z3_tp2_from_d3, z2_from_z3, z3_tp2_from_z3, llama_z3_resumed = run_distributed(
        train, world_size=4, timeout=600, args=(
            [_argv(tiny_corpus, *ZERO3, **from_d3),
             _argv(tiny_corpus, *ZERO3, **from_d3, train_iters=5, save=d["z3_loaded"], save_interval=100),
             _argv(tiny_corpus, *ZERO2, **from_d3),
             _argv(tiny_corpus, *ZERO3, *tp2, **from_d3),
             _argv(tiny_corpus, *ZERO2, **from_z3),
             _argv(tiny_corpus, *ZERO3, *tp2, **from_z3),
             _llama_argv(tiny_corpus, *ZERO3, load=d["llama_d3_for_z3"], universal_checkpoint=True)],))[0]
    runs = dict(z3=z3, z2=z2, d3=d3, d3_resumed=d3_resumed, d3_loaded=d3_loaded, d3_from_z2=d3_from_z2,
                z3_resumed=z3_resumed, z3_loaded=z3_loaded, z2_from_d3=z2_from_d3, z3_tp2_from_d3=z3_tp2_from_d3,
                z2_from_z3=z2_from_z3, z3_tp2_from_z3=z3_tp2_from_z3, llama_z3=llama_z3, llama_d3=llama_d3,
                llama_d3_resumed=llama_d3_resumed, llama_z3_resumed=llama_z3_resumed)
    return runs, d


@pytest.mark.multiprocess
def test_zero3_checkpoint_continues_on_3d(reshaped):
    runs, _ = reshaped
    assert runs["z3"]["iterations"] == list(range(1, 11)) and runs["d3_resumed"]["iterations"] == list(range(6, 11))
    assert runs["z3"]["losses"][-1] < runs["z3"]["losses"][0] - 0.02, runs["z3"]["losses"]  # it learns
    assert_continues(runs["z3"]["losses"], runs["d3_resumed"]["losses"], "ZeRO-3 -> 3D vs ZeRO-3 continuing", dtype=torch.float32)
    assert_continues(runs["d3"]["losses"], runs["d3_resumed"]["losses"], "ZeRO-3 -> 3D vs 3D straight", dtype=torch.float32)


@pytest.mark.multiprocess
def test_3d_checkpoint_continues_on_zero3(reshaped):
    runs, _ = reshaped
    assert runs["z3_resumed"]["iterations"] == list(range(6, 11))
    assert_continues(runs["d3"]["losses"], runs["z3_resumed"]["losses"], "3D -> ZeRO-3 vs 3D continuing", dtype=torch.float32)
    assert_continues(runs["z3"]["losses"], runs["z3_resumed"]["losses"], "3D -> ZeRO-3 vs ZeRO-3 straight", dtype=torch.float32)
    # at TP = 2 x DP = 2 too: the loader cuts the TP slices (megatron.engine.model_engine.universal_tp_restore)
    assert runs["z3_tp2_from_d3"]["iterations"] == list(range(6, 11))
    assert_continues(runs["d3"]["losses"], runs["z3_tp2_from_d3"]["losses"], "3D -> ZeRO-3 TP=2 vs 3D continuing",
                     dtype=torch.float32)


@pytest.mark.multiprocess
def test_zero2_checkpoint_continues_on_3d_and_3d_on_zero2(reshaped):
    runs, _ = reshaped
    assert runs["d3_from_z2"]["iterations"] == list(range(6, 11)) == runs["z2_from_d3"]["iterations"]
    assert_continues(runs["z2"]["losses"], runs["d3_from_z2"]["losses"], "ZeRO-2 -> 3D vs ZeRO-2 continuing", dtype=torch.float32)
    assert_continues(runs["d3"]["losses"], runs["d3_from_z2"]["losses"], "ZeRO-2 -> 3D vs 3D straight", dtype=torch.float32)
    assert_continues(runs["d3"]["losses"], runs["z2_from_d3"]["losses"], "3D -> ZeRO-2 vs 3D continuing", dtype=torch.float32)
    assert_continues(runs["z2"]["losses"], runs["z2_from_d3"]["losses"], "3D -> ZeRO-2 vs ZeRO-2 straight", dtype=torch.float32)


@pytest.mark.multiprocess
def test_zero3_tp1_checkpoint_continues_on_zero2_and_zero3_at_tp2(reshaped):
    """ZeRO-3 at TP = 1 stores flat tensors; converted for its own engine they are rewritten full-shaped, so
    ZeRO-2 and ZeRO-3 runs at TP = 2 x DP = 2 take their TP slices."""
    runs, _ = reshaped
    for label in ("z2_from_z3", "z3_tp2_from_z3"):
        assert runs[label]["iterations"] == list(range(6, 11)), label
        assert_continues(runs["z3"]["losses"], runs[label]["losses"], f"{label} vs ZeRO-3 continuing", dtype=torch.float32)


@pytest.mark.multiprocess
def test_loading_gives_the_saved_weights_and_optimizer_step(reshaped):
    """Loaded and saved again at once, on the other engine: the same full weights, bit for bit; Adam's step is
    the source's in every parameter group (a tensor of its own each: ZeRO-3's loader shares one, which Adam
    would count up once per group), and each group keeps its own weight decay (ZeRO-3's loader copies the
    first group's onto all)."""
    from megatron.checkpoint.single_process import load_full_state_dict

    runs, d = reshaped
    for source, loaded in (("z3", "d3_loaded"), ("d3", "z3_loaded")):
        assert runs[loaded]["iterations"] == [], loaded
        _, saved, _ = load_full_state_dict(d[source], "global_step5")
        _, reloaded, record = load_full_state_dict(d[loaded])
        assert record["progress"]["iteration"] == 5 and record["progress"]["consumed_samples"] == 40
        assert set(saved) == set(reloaded), (source, set(saved) ^ set(reloaded))
        for name, tensor in saved.items():
            assert torch.equal(reloaded[name].float(), tensor.float()), \
                f"{source} -> {loaded} {name}: max diff {(reloaded[name].float() - tensor.float()).abs().max()}"
        steps = runs[loaded]["steps"]
        assert steps and set(steps) == {5.0} and runs[loaded]["step_objects"] == len(steps), (loaded, runs[loaded])
        assert runs[loaded]["groups"] == [("decay", 0.01), ("no_decay", 0.0)], (loaded, runs[loaded]["groups"])
    # ZeRO-3's own groups: the weight matrices decay (its parameters are 1-D placeholders until gathered)
    assert runs["z3"]["groups"] == [("decay", 0.01), ("no_decay", 0.0)], runs["z3"]["groups"]


@pytest.mark.multiprocess
def test_a_universal_checkpoint_for_the_other_engine_is_refused_by_name(reshaped, tiny_corpus, tmp_path):
    from megatron.arguments import run_config_from_argv
    from megatron.checkpoint.resume import resume_point

    _, d = reshaped
    cases = [(_argv(tiny_corpus, *ZERO3, load=d["z3_for_3d"], universal_checkpoint=True), 4,
              "--target-engine model"),
             (_argv(tiny_corpus, *THREE_D, load=d["d3_for_z3"], universal_checkpoint=True), 8,
              "--target-engine pipeline"),
             (_argv(tiny_corpus, *ZERO2, load=d["z2_for_3d"], universal_checkpoint=True), 4,
              "--target-engine model")]
    for argv, world_size, expected in cases:
        with pytest.raises(ValueError, match=expected):
            resume_point(run_config_from_argv(argv, world_size=world_size))
    # converted before the record of its engine existed: DeepSpeed's own ZeRO-3 files, read at TP = 1 only
    old = tmp_path / "old"
    shutil.copytree(d["d3_for_z3"], old)
    record_path = old / "global_step5_universal" / "run_state.json"
    record = json.loads(record_path.read_text())
    for field in ("universal_engine", "saving_engine", "weight_files"):  # none of them recorded then
        del record[field]
    record["parallel"]["zero_stage"] = 3
    record_path.write_text(json.dumps(record))
    for extra in (ZERO2, ZERO3 + ["--tensor-model-parallel-size", "2"]):
        with pytest.raises(ValueError, match="convert its source checkpoint again"):
            resume_point(run_config_from_argv(_argv(tiny_corpus, *extra, load=str(old), universal_checkpoint=True),
                                              world_size=4))
    assert resume_point(run_config_from_argv(_argv(tiny_corpus, *ZERO3, load=str(old), universal_checkpoint=True),
                                             world_size=4))[0] == "global_step5_universal"


@pytest.mark.multiprocess
def test_retargeted_files_carry_checksums_and_load_safely(reshaped, tmp_path):
    """Every renamed file is in checksums.json and matches it; a name the layout does not know, a missing
    parameter and a crafted pickle in a converted folder are refused by name (the pickle never runs)."""
    from megatron.checkpoint.integrity import CHECKSUMS, verify_checksums
    from megatron.checkpoint.run_state import load_run_state, model_config_from_dict
    from megatron.checkpoint.tags import CheckpointFormatError
    from megatron.checkpoint.universal.engines import folder_names, retarget

    _, d = reshaped
    for out_root, engine in ((d["z3_for_3d"], "pipeline"), (d["d3_for_z3"], "model")):
        tag_dir = os.path.join(out_root, "global_step5_universal")
        config = model_config_from_dict(load_run_state(out_root, "global_step5_universal")["model_config"])
        assert set(os.listdir(os.path.join(tag_dir, "zero"))) - {"optimizer_state.pt"} == set(folder_names(config, engine))
        with open(os.path.join(tag_dir, CHECKSUMS)) as f:
            recorded = set(json.load(f))
        written = {os.path.relpath(os.path.join(folder, name), tag_dir).replace(os.sep, "/")
                   for folder, _, names in os.walk(tag_dir) for name in names}
        assert written - recorded == {CHECKSUMS, "complete", "run_state.json"}, written - recorded
        assert verify_checksums(tag_dir, distributed=False) == []

    # A native ZeRO-3 conversion (GPTModel's names), copied three times and spoilt three ways
    native = tmp_path / "native" / "global_step5_universal"
    to_universal(os.path.join(d["z3"], "global_step5"), native)
    config = model_config_from_dict(load_run_state(str(native.parent), native.name)["model_config"])
    spoilt = {name: tmp_path / name for name in ("unknown", "missing", "crafted")}
    for folder in spoilt.values():
        shutil.copytree(native, folder)
    shutil.copytree(native / "zero" / "final_layernorm.weight", spoilt["unknown"] / "zero" / "final_norm.weight")
    shutil.rmtree(spoilt["missing"] / "zero" / "layers.1.mlp.dense_4h_to_h.weight")
    marker = tmp_path / "payload_ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    target = spoilt["crafted"] / "zero" / "layers.0.self_attention.dense.weight" / "exp_avg.pt"
    torch.save({"param": torch.load(target, weights_only=False), "extra": Payload()}, target)
    # a ZeRO-3 run saved before its weight-decay groups were mended has one parameter group: ZeRO-1's loader
    # sets Adam's step only in groups the record lists, so the record for it lists the target's two
    one_group = tmp_path / "one_group"
    shutil.copytree(native, one_group)
    state_path = one_group / "zero" / "optimizer_state.pt"
    state = torch.load(state_path, weights_only=False)
    state["param_groups"] = state["param_groups"][:1]
    torch.save(state, state_path)
    assert retarget(str(one_group), config, "model", "pipeline") == len(folder_names(config, "pipeline"))
    groups = torch.load(state_path, weights_only=False)["param_groups"]
    assert len(groups) == 2 and groups[0]["name"] == groups[1]["name"] == "decay", groups
    for name, match in (("unknown", r"not in the model: \['final_norm.weight'\]"),
                        ("missing", r"missing: \['layers.1.mlp.dense_4h_to_h.weight'\]"),
                        ("crafted", "layers.0.self_attention.dense.weight/exp_avg.pt")):
        with pytest.raises(CheckpointFormatError, match=match):
            retarget(str(spoilt[name]), config, "model", "pipeline")
    assert not marker.exists()



@pytest.mark.multiprocess
def test_llama_untied_head_moves_between_zero3_and_3d(reshaped):
    """Llama-style (untied output_layer.weight, grouped-query QKV, SwiGLU, RMSNorm): ZeRO-3 -> 3D and 3D -> ZeRO-3
    continue within ``run_tolerance`` of the target layout's straight run."""
    runs, d = reshaped
    z3, d3, d3_resumed, z3_resumed = (runs[f"llama_{name}"] for name in ("z3", "d3", "d3_resumed", "z3_resumed"))
    assert "output_layer.weight" in os.listdir(os.path.join(d["llama_d3_for_z3"], "global_step5_universal", "zero"))
    assert d3_resumed["iterations"] == list(range(6, 11)) == z3_resumed["iterations"]
    assert_continues(d3["losses"], d3_resumed["losses"], "Llama ZeRO-3 -> 3D vs 3D straight", dtype=torch.float32)
    assert_continues(z3["losses"], d3_resumed["losses"], "Llama ZeRO-3 -> 3D vs ZeRO-3 continuing", dtype=torch.float32)
    assert_continues(z3["losses"], z3_resumed["losses"], "Llama 3D -> ZeRO-3 vs ZeRO-3 straight", dtype=torch.float32)
    assert_continues(d3["losses"], z3_resumed["losses"], "Llama 3D -> ZeRO-3 vs 3D continuing", dtype=torch.float32)
