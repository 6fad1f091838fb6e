"""Pretrain a GPT / BLOOM model with tensor, pipeline and data parallelism.

Launch with torchrun, the DeepSpeed launcher or srun; the flags are Megatron-DeepSpeed's
(``python pretrain_gpt.py --help`` lists them; docs/flags.md is the same list).
"""

import os
import sys

from megatron.training.exit import die_with_launcher, install_early_signal_handler

install_early_signal_handler()  # before the slow imports: a SIGTERM during start-up still ends in a clean save
die_with_launcher()  # under torchrun: no orphaned workers when the launcher is killed

os.environ.setdefault("DS_ACCELERATOR", "cpu" if not __import__("torch").cuda.is_available() else "cuda")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--dry-run" in argv:  # check and plan the job, start nothing (docs/slurm.md)
        from megatron.dry_run import dry_run

        return dry_run(argv)
    from megatron.arguments import run_config_from_argv
    from megatron.config.launch import detect_launch

    try:
        run_config = run_config_from_argv(argv)
    except ValueError as error:  # bad flags: one line, from one process (every rank sees the same flags)
        if detect_launch().rank == 0:
            print(f"error: {error}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from megatron.checkpoint.training_io import CheckpointSaveError
    from megatron.training.guards import NonFiniteLossError
    from megatron.training.pretrain import pretrain

    status = 0
    try:
        pretrain(run_config)
    except (ValueError, NonFiniteLossError, CheckpointSaveError) as error:
        # A refusal (--load, --save's lock, a damaged file), a diverged run or a failed save (a full disk): one
        # line per rank that met it, or one from rank 0 when every rank meets the same one (files every rank
        # reads, agreed values).
        rank = detect_launch().rank
        if not getattr(error, "on_every_rank", False):
            print(f"error (rank {rank}): {error}", file=sys.stderr, flush=True)
        elif rank == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        status = 2 if isinstance(error, ValueError) else 1  # a refusal to start, or a run that stopped
    # Every rank gets here: tear the groups down now, not in the interpreter's shutdown, where the
    # backend's threads can be destroyed in any order (a C++ terminate seen once under srun).
    if dist.is_initialized():
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
