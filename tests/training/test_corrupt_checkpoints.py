"""A checkpoint whose values were corrupted (NaN where a flipped bit or overwritten bytes put one) is
refused at --load, naming the tensor, instead of training on and saving the NaNs again."""

import json
import math

import pytest
import torch

from megatron.checkpoint.integrity import record_checksums
from megatron.checkpoint.safe_load import safe_load
from megatron.testing import run_distributed, tiny_argv
from tests.helpers.training import pretrain_error, train


@pytest.fixture(scope="module")
def saved(tiny_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("corrupt")
    argv = tiny_argv(tiny_corpus, "--bf16", train_iters=4, save=str(root / "ckpt"), save_interval=2, exit_interval=2)
    run_distributed(train, world_size=1, args=([argv],), timeout=300)
    return tiny_corpus, root / "ckpt"


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.multiprocess
def test_nan_in_weights_or_fp32_masters_is_refused_by_name(saved, tmp_path):
    from megatron.engine.deepspeed_compat import DEEPSPEED_GLOBALS

    corpus, ckpt = saved
    weights = _copy(ckpt, tmp_path / "weights")
    layer = weights / "global_step2" / "layer_03-model_00-model_states.pt"
    tensors = safe_load(str(layer))
    with torch.no_grad():
        tensors["mlp.dense_h_to_4h.weight"][3, 5] = float("nan")
    torch.save(tensors, layer)
    record_checksums(str(layer.parent), distributed=False)  # NaNs that were already there when it was saved

    masters = _copy(ckpt, tmp_path / "masters")
    (optim,) = (masters / "global_step2").glob("bf16_zero_pp_rank_0_*optim_states.pt")
    state = safe_load(str(optim), extra_globals=DEEPSPEED_GLOBALS)
    with torch.no_grad():
        state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][7] = float("inf")
    torch.save(state, optim)
    record_checksums(str(optim.parent), distributed=False)

    runs = [tiny_argv(corpus, "--bf16", train_iters=4, load=str(path)) for path in (weights, masters)]
    messages = [run_distributed(pretrain_error, world_size=1, args=(argv,), timeout=300)[0] for argv in runs]
    assert messages[0] is not None and "non-finite" in messages[0], messages[0]
    assert "weights of layers.0.mlp.dense_h_to_4h.weight" in messages[0], messages[0]
    assert messages[1] is not None and "fp32 master weights of" in messages[1], messages[1]
    # The untouched checkpoint resumes.
    (clean,) = run_distributed(train, world_size=1, args=([tiny_argv(corpus, "--bf16", train_iters=4,
                                                                          load=str(ckpt))],), timeout=300)[0]
    assert [i for i, *_ in clean["history"]] == [3, 4] and all(math.isfinite(r[1]) for r in clean["history"])


@pytest.fixture(scope="module")
def two_saves(tiny_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("two_saves")
    argv = tiny_argv(tiny_corpus, "--bf16", train_iters=4, save=str(root / "ckpt"), save_interval=2)
    run_distributed(train, world_size=1, args=([argv],), timeout=300)
    return tiny_corpus, root / "ckpt"


def _flip_a_byte(path, offset=-100):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01  # a flipped bit deep in the tensor data: still a finite number
    path.write_bytes(bytes(data))


@pytest.mark.multiprocess
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one_or_is_refused(two_saves, tmp_path):
    from megatron.checkpoint.single_process import load_full_state_dict
    from megatron.checkpoint.tags import CheckpointFormatError

    corpus, ckpt = two_saves
    damaged = _copy(ckpt, tmp_path / "ckpt")
    assert json.loads((damaged / "global_step4" / "checksums.json").read_text())  # recorded at save time
    _flip_a_byte(damaged / "global_step4" / "layer_03-model_00-model_states.pt")
    with pytest.raises(CheckpointFormatError, match=r"global_step4.*layer_03-model_00-model_states.pt does not "
                                                    r"match its SHA-256"):
        load_full_state_dict(str(damaged))
    argv = tiny_argv(corpus, "--bf16", train_iters=4, load=str(damaged))
    # --no-load-fallback: refused, naming the file, instead of resuming from an older checkpoint.
    message = run_distributed(pretrain_error, world_size=1, args=(argv + ["--no-load-fallback"],), timeout=300)[0]
    assert message is not None and "global_step4 is damaged" in message and "--no-load-fallback" in message, message
    assert "layer_03-model_00-model_states.pt does not match its SHA-256" in message
    (run,) = run_distributed(train, world_size=1, args=([argv],), timeout=300)[0]
    assert [i for i, *_ in run["history"]] == [3, 4]  # resumed from global_step2, the intact one

    (damaged / "global_step2" / "mp_rank_00_model_states.pt").write_bytes(b"")  # now neither is intact
    message = run_distributed(pretrain_error, world_size=1, args=(argv,), timeout=300)[0]
    assert message is not None and "global_step4 is damaged and no earlier checkpoint" in message, message
    assert "layer_03-model_00-model_states.pt does not match its SHA-256" in message
