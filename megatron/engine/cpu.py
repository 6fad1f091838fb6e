"""DeepSpeed on the CPU accelerator: avoid its JIT C++ builds.

On the CPU accelerator DeepSpeed compiles two extensions the first time they are touched, each
taking most of a minute on a fresh machine (see ../shared/ARCHITECTURE.md):

- the shared-memory all-reduce (``deepspeed_shm_comm``), built in ``TorchBackend.__init__`` during
  ``deepspeed.init_distributed`` although only inference all-reduce uses it; we mark it incompatible
  so DeepSpeed skips it and plain torch.distributed (gloo) carries every collective;
- CPU FusedAdam, avoided by always handing DeepSpeed a client ``torch.optim.AdamW`` (see
  ``megatron.engine.optimizer``) and never an ``optimizer`` section in the DeepSpeed config.

``check_cpu_compiler``: --torch-compile on CPU needs a C++ compiler (inductor writes C++); a clear refusal
before training where none is installed.

On GPUs nothing here changes anything.
"""

from __future__ import annotations

import os
import shutil

import deepspeed
from deepspeed.accelerator import get_accelerator


def on_cpu_accelerator() -> bool:
    return get_accelerator().device_name() == "cpu"


def avoid_cpu_jit_builds() -> None:
    """Mark DeepSpeed's shared-memory comm op as unavailable on the CPU accelerator."""
    if not on_cpu_accelerator():
        return
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def check_cpu_compiler() -> str:
    """The C++ compiler inductor uses for CPU code (``$CXX``, else g++ / c++ / clang++); ValueError if none."""
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    for name in candidates:
        path = shutil.which(name)
        if path:
            return path
    raise ValueError(f"--torch-compile on CPU needs a C++ compiler for torch inductor's generated code; none of "
                     f"{', '.join(candidates)} is on PATH. Install one (e.g. apt-get install g++) or drop "
                     f"--torch-compile")
