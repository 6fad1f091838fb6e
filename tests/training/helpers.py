"""Helpers shared by the end-to-end training tests."""


def run_single(rank, world_size, runs):
    """On each rank (a ``run_distributed`` target): ``pretrain`` every argv of ``runs`` in turn, and
    return, per run, its exit reason, last iteration, per-iteration history and validation results."""
    from megatron.arguments import run_config_from_argv
    from megatron.training.pretrain import pretrain

    out = []
    for argv in runs:
        result = pretrain(run_config_from_argv(argv, world_size=world_size))
        out.append({"reason": result.exit_reason, "iteration": result.progress.iteration,
                    "history": [(r.iteration, r.loss, r.grad_norm, r.lr, r.global_batch_size) for r in result.history],
                    "valid": result.valid})
    return out


def pretrain_error(rank, world_size, argv):
    """On each rank: ``pretrain(argv)``; the ValueError's message if it refused to run, else None."""
    from megatron.arguments import run_config_from_argv
    from megatron.training.pretrain import pretrain

    try:
        pretrain(run_config_from_argv(argv, world_size=world_size))
    except ValueError as error:
        return str(error)
    return None
