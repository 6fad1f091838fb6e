"""Tensor-parallel serving: one model split over the N processes of ``torchrun --nproc_per_node N``.

    torchrun --nproc_per_node 2 tools/serve.py --load CKPT --port 8000

Every rank loads its part of the model (a checkpoint of any TP / PP: merged, then split for this TP
size, ``Generator.from_checkpoint(parallel_state=...)``). Rank 0 runs the HTTP server and the batch
scheduler; whatever its ``BatchRunner`` does to the model (a prompt's pass, a batch step, rows
leaving, a reset) it first broadcasts to the other ranks (``BroadcastRunner``), which replay it on
their part (``follow``). So all ranks run the same forwards, whose all-reduces and the final
all-gather of the logits pair up; only rank 0 samples, and its tokens travel in the next step's
message. The messages are small Python objects (``broadcast_object_list``); the collectives run on
gloo on CPU, NCCL on GPU. An idle rank 0 sends a heartbeat every ``IDLE_SECONDS`` so that the others
do not time out; rank 0 stopping sends "stop" and every rank exits.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import torch
import torch.distributed as dist

from megatron.inference.batching import BatchRunner

__all__ = ["BroadcastRunner", "follow", "serving_device"]

logger = logging.getLogger(__name__)


def serving_device() -> torch.device:
    """This rank's GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


class BroadcastRunner(BatchRunner):
    """Rank 0's runner: each call is sent to the other ranks of ``group`` before it runs here."""

    def __init__(self, model, vocab_size: int, group):
        super().__init__(model, vocab_size)
        self.group = group
        self._source = dist.get_global_rank(group, 0)

    def _send(self, *message) -> None:
        dist.broadcast_object_list([message], src=self._source, group=self.group)

    def prefill(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        self._send("prefill", [list(prompt) for prompt in prompts])
        return super().prefill(prompts)

    def decode(self, tokens: Sequence[int]) -> torch.Tensor:
        self._send("decode", list(tokens))
        return super().decode(tokens)

    def keep_rows(self, rows: Sequence[int]) -> None:
        self._send("keep_rows", list(rows))
        super().keep_rows(rows)

    def reset(self) -> None:
        self._send("reset")
        super().reset()

    def idle(self) -> None:
        self._send("idle")

    def stop(self) -> None:
        """Tell the other ranks to return from ``follow``."""
        self._send("stop")


def follow(runner: BatchRunner, group) -> None:
    """On ranks other than 0: replay rank 0's calls on this rank's part of the model until "stop"."""
    source = dist.get_global_rank(group, 0)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=source, group=group)
        operation, *args = box[0]
        if operation == "stop":
            return
        if operation == "idle":
            continue
        try:
            getattr(runner, operation)(*args)
        except Exception:  # noqa: BLE001 - rank 0 failed the same way; it answers the request and resets
            logger.debug("replayed %s failed", operation, exc_info=True)
