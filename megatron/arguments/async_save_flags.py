"""The asynchronous checkpoint flag (one argument group): Megatron-LM's ``--async-save`` (the writer:
``megatron.checkpoint.async_save``; the rule: ``CheckpointConfig``'s).
"""

from __future__ import annotations

__all__ = ["add_async_save_arguments"]


def add_async_save_arguments(parser) -> None:
    g = parser.add_argument_group("asynchronous checkpoint saving (--async-save)")
    g.add_argument("--async-save", action="store_true",
                   help="Save checkpoints in the background (Megatron-LM's flag): the step loop copies the state "
                        "to host memory (pinned on CUDA) and goes on; a thread writes the files, fsyncs and hashes "
                        "them, and the checkpoint is marked complete and named by 'latest' once every rank's "
                        "writer is done (checked after each step). The next save, SIGTERM and the end of training "
                        "wait for it; a failed write (a full disk) stops the run at the next step with the "
                        "synchronous save's error. Needs --save; costs host memory for one copy of this rank's "
                        "checkpoint. Default: synchronous saves.")
