"""A checkpoint whose values were corrupted (NaN where a flipped bit or overwritten bytes put one) is
refused at --load, naming the tensor, instead of training on and saving the NaNs again."""

import math

import pytest
import torch

from megatron.checkpoint.safe_load import safe_load
from megatron.testing import run_distributed, tiny_argv
from tests.training.helpers import pretrain_error, run_single


@pytest.fixture(scope="module")
def saved(tiny_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("corrupt")
    argv = tiny_argv(tiny_corpus, "--bf16", train_iters=4, save=str(root / "ckpt"), save_interval=2, exit_interval=2)
    run_distributed(run_single, world_size=1, args=([argv],), timeout=300)
    return tiny_corpus, root / "ckpt"


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.multiprocess
def test_nan_in_weights_or_fp32_masters_is_refused_by_name(saved, tmp_path):
    from megatron.engine.checkpoint_engine import DEEPSPEED_GLOBALS

    corpus, ckpt = saved
    weights = _copy(ckpt, tmp_path / "weights")
    layer = weights / "global_step2" / "layer_03-model_00-model_states.pt"
    tensors = safe_load(str(layer))
    with torch.no_grad():
        tensors["mlp.dense_h_to_4h.weight"][3, 5] = float("nan")
    torch.save(tensors, layer)

    masters = _copy(ckpt, tmp_path / "masters")
    (optim,) = (masters / "global_step2").glob("bf16_zero_pp_rank_0_*optim_states.pt")
    state = safe_load(str(optim), extra_globals=DEEPSPEED_GLOBALS)
    with torch.no_grad():
        state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][7] = float("inf")
    torch.save(state, optim)

    runs = [tiny_argv(corpus, "--bf16", train_iters=4, load=str(path)) for path in (weights, masters)]
    messages = [run_distributed(pretrain_error, world_size=1, args=(argv,), timeout=300)[0] for argv in runs]
    assert messages[0] is not None and "non-finite" in messages[0], messages[0]
    assert "weights of layers.0.mlp.dense_h_to_4h.weight" in messages[0], messages[0]
    assert messages[1] is not None and "fp32 master weights of" in messages[1], messages[1]
    # The untouched checkpoint resumes.
    (clean,) = run_distributed(run_single, world_size=1, args=([tiny_argv(corpus, "--bf16", train_iters=4,
                                                                          load=str(ckpt))],), timeout=300)[0]
    assert [i for i, *_ in clean["history"]] == [3, 4] and all(math.isfinite(r[1]) for r in clean["history"])
