"""DeepSpeed on the CPU accelerator: which accelerator runs, and a C++ compiler for --torch-compile.

On the CPU accelerator DeepSpeed compiles two extensions the first time they are touched, each
taking most of a minute on a fresh machine: the shared-memory
all-reduce, marked incompatible before ``deepspeed.init_distributed``
(``megatron.engine.deepspeed_compat.avoid_cpu_jit_builds``), and CPU FusedAdam, avoided by always
handing DeepSpeed a client ``torch.optim.AdamW`` (``megatron.engine.optimizer``) and never an
``optimizer`` section in the DeepSpeed config.

``check_cpu_compiler``: --torch-compile on CPU needs a C++ compiler (inductor writes C++); a clear refusal
before training where none is installed.
"""

from __future__ import annotations

import os
import shutil

from deepspeed.accelerator import get_accelerator


def on_cpu_accelerator() -> bool:
    return get_accelerator().device_name() == "cpu"


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
