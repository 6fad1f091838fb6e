"""One rank of bench_startup.py, launched by torchrun (``-m benchmarks._startup_child`` from the checkout's
root, which puts pretrain_gpt.py and megatron/ on the path): pretrain_gpt.py with timers around it.

Records (wall-clock, seconds since the epoch): when this interpreter started running this file,
when the imports were done, when the first train_batch began and ended, and for every train_batch
its duration and the time spent inside next() on the training data iterator (wrapped). Writes
$BENCH_STARTUP_OUT/rank<r>.json. Nothing of the library is changed; the wrappers are installed
on this process's objects only.
"""

import time

T_START = time.time()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402,F401
import torch  # noqa: E402,F401
from deepspeed.runtime.pipe.engine import PipelineEngine  # noqa: E402

import megatron.training.pretrain as pretrain_module  # noqa: E402
import pretrain_gpt  # noqa: E402

T_IMPORTED = time.time()
DATA_WAIT = {"s": 0.0}
STEPS: list[dict] = []


class TimedIterator:
    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        return self

    def __next__(self):
        t = time.perf_counter()
        try:
            return next(self.inner)
        finally:
            DATA_WAIT["s"] += time.perf_counter() - t


_original_iterator = pretrain_module.micro_batch_iterator
_calls = {"n": 0}


def micro_batch_iterator(*args, **kwargs):
    _calls["n"] += 1
    it = _original_iterator(*args, **kwargs)
    return TimedIterator(it) if _calls["n"] == 1 else it  # the first one built is the training iterator


_original_train_batch = PipelineEngine.train_batch


def train_batch(self, *args, **kwargs):
    wait0, t0 = DATA_WAIT["s"], time.time()
    try:
        return _original_train_batch(self, *args, **kwargs)
    finally:
        STEPS.append({"start": t0, "end": time.time(), "data_wait_s": DATA_WAIT["s"] - wait0})


pretrain_module.micro_batch_iterator = micro_batch_iterator
PipelineEngine.train_batch = train_batch

if __name__ == "__main__":
    pretrain_gpt.main(sys.argv[1:])
    out = os.environ["BENCH_STARTUP_OUT"]
    with open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump({"t_start": T_START, "t_imported": T_IMPORTED, "steps": STEPS}, f)
