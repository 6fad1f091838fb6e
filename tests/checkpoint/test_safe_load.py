"""``only_safe_loading``: code that asks torch for ``weights_only=False`` (DeepSpeed's) gets the safe load."""

import io
import os

import pytest
import torch

from megatron.checkpoint.safe_load import only_safe_loading
from megatron.checkpoint.tags import CheckpointFormatError


class _Payload:
    """Unpickling this calls ``open(path, "w")``: it would create ``path``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_every_torch_load_inside_is_weights_only_and_names_the_file(tmp_path):
    marker = tmp_path / "payload_ran"
    crafted, plain = tmp_path / "crafted.pt", tmp_path / "plain.pt"
    torch.save({"w": torch.ones(3), "extra": _Payload(str(marker))}, crafted)
    torch.save({"w": torch.arange(4.0)}, plain)
    original, env_before = torch.load, os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    with only_safe_loading():
        assert os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] == "1"  # processes started inside refuse too
        assert torch.equal(torch.load(str(plain), weights_only=False)["w"], torch.arange(4.0))
        with pytest.raises(CheckpointFormatError, match=r"crafted\.pt.*weights_only=True"):
            torch.load(crafted, map_location="cpu", weights_only=False)  # a PathLike, as DeepSpeed passes
        with pytest.raises(Exception, match="Unsupported global"):
            torch.load(io.BytesIO(crafted.read_bytes()), weights_only=False)  # a file object
    assert not marker.exists()
    assert torch.load is original and os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") == env_before
    if env_before is None:
        torch.load(crafted, weights_only=False)  # outside, torch's own load again: this one runs the payload
        assert marker.exists()


class _Command:
    """Unpickling this would call ``os.system`` (pickled as ``posix.system``)."""

    def __reduce__(self):
        return (os.system, ("true",))


def test_a_refusal_names_only_the_globals_outside_the_allowlist(tmp_path):
    import numpy as np

    from megatron.checkpoint.safe_load import safe_load

    path = tmp_path / "mixed.pt"
    torch.save({"rng": np.random.RandomState(0).get_state(), "w": torch.ones(2), "run": _Command()}, path)
    with pytest.raises(CheckpointFormatError) as refused:
        safe_load(str(path))
    message = str(refused.value)
    assert "it asks for ['posix.system'], which only an unsafe load would import" in message, message
    assert "numpy" not in message and "\n" not in message, message  # the allowed ones are not listed; one line
