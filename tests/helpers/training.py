"""Training runs for the end-to-end tests: run them, compare them, convert their checkpoints.

    train(rank, world_size, runs)         a run_distributed target: pretrain each argv in turn, one record each
    record_run(rc, result)                that record, for a target that does more around pretrain
    pretrain_error(rank, world_size, argv)  the ValueError pretrain refused with, or None
    layout(argv, *flags, tp=, pp=)        argv with a layout's flags appended
    assert_same_run(reference, other, label, dtype)  per-iteration losses and grad norms agree (run_tolerance)
    assert_continues(straight, tail, label, dtype)  a resumed run's losses continue a straight run's (exactly
                                          where dtype is None)
    weights_tolerance(dtype, iterations, max_lr, scale)  how far such runs' weights can be apart
    tensorboard_scalars(logdir)           {tag: [(step, value)]} of a run's tensorboard events
    to_universal(tag_dir, output_dir=None, *flags)  ds_to_universal.py, asserted to succeed
    convert_to_universal(tag_dir, output_dir=None, *flags)  the same, returning the finished process
    MANY_LAYOUTS                          the pytest-timeout mark of a module whose launches train many layouts
"""

import multiprocessing
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from megatron.testing.tolerance import run_tolerance
from tests.helpers.paths import REPO_ROOT

# For a module whose launches train many layouts (``pytestmark = MANY_LAYOUTS``): on two loaded cores such a set-up
# took 205-305 s, against pytest-timeout's 300 s default; the hang guard is the launches' own limit instead
# (run_distributed's timeout).
MANY_LAYOUTS = pytest.mark.timeout(900)

DS_TO_UNIVERSAL = REPO_ROOT / "tools" / "convert_checkpoint" / "ds_to_universal.py"


def train(rank, world_size, runs):
    """On each rank (a ``run_distributed`` target): ``pretrain`` every argv of ``runs`` in turn and return,
    per run, ``record_run``'s record."""
    from megatron.arguments import run_config_from_argv
    from megatron.training.pretrain import pretrain

    out = []
    for argv in runs:
        rc = run_config_from_argv(argv, world_size=world_size)
        out.append(record_run(rc, pretrain(rc)))
    return out


def record_run(rc, result) -> dict:
    """What the tests check of one finished run: how it ended, its per-iteration history (also split into
    iterations, losses, grad norms, learning rates), its validation results, the settings asked for, and
    how the engine holds the model and the optimizer (``_engine_record``)."""
    history = result.history
    return {"reason": result.exit_reason, "iteration": result.progress.iteration, "valid": result.valid,
            "history": [(r.iteration, r.loss, r.grad_norm, r.lr, r.global_batch_size) for r in history],
            "iterations": [r.iteration for r in history], "losses": [r.loss for r in history],
            "grad_norms": [r.grad_norm for r in history], "lrs": [r.lr for r in history],
            "model_sp": rc.model.sequence_parallel, "asked_stage": rc.precision.zero_stage,
            "warnings": list(rc.startup_warnings), **_engine_record(result.engine)}


def _engine_record(engine) -> dict:
    import torch.distributed as dist
    from deepspeed.utils import groups

    params = list(engine.module.parameters())
    optimizer = engine.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)
    steps = [state["step"] for state in inner.state.values() if "step" in state]
    hpz = groups._get_zero_param_intra_parallel_group()
    grid = getattr(engine, "grid", None)  # the pipeline engine's
    return {
        "engine": type(engine).__name__, "engine_stage": engine.zero_optimization_stage(),
        "pipe_partitioned": getattr(engine, "is_pipe_partitioned", None),
        "dp_size": grid.get_data_parallel_world_size() if grid is not None else None,
        "optimizer": type(optimizer).__name__,
        "groups": [(g.get("name"), g["weight_decay"]) for g in optimizer.param_groups],
        "steps": [float(s) for s in steps], "step_objects": len({id(s) for s in steps}),  # Adam's step counts
        "held_numel": sum(p.numel() for p in params),  # this stage's; 0 under ZeRO-3: placeholders only
        "master_numel": sum(p.numel() for p in getattr(optimizer, "fp32_groups_flat_partition", [])),  # BF16_Optimizer
        "partition_numel": sum(p.ds_tensor.numel() for p in params if hasattr(p, "ds_tensor")),
        "full_numel": sum(getattr(p, "ds_numel", p.numel()) for p in params),
        "hpz_ranks": dist.get_process_group_ranks(hpz) if hpz is not None else None,
        "hpz_ranks_engine": getattr(engine, "hpz_ranks", None),
        "compiled_layers": sum(getattr(m, "_compiled_call_impl", None) is not None
                               for m in engine.module.modules()),  # --torch-compile's layers
        "executed_steps": getattr(engine, "executed_steps", None),  # ZB-H1's last step, instruction names
        "stage": getattr(engine, "stage_id", None),
        "parts": [int(p) for p in getattr(engine.module, "parts", [])],  # the pipeline engine's stage bounds
        "held_layers": sum(type(m).__name__ == "TransformerLayer" for m in engine.module.modules()),
    }


def pretrain_error(rank, world_size, argv):
    """On each rank: ``pretrain(argv)``; the ValueError's message if it refused to run, else None."""
    from megatron.arguments import run_config_from_argv
    from megatron.training.pretrain import pretrain

    try:
        pretrain(run_config_from_argv(argv, world_size=world_size))
    except ValueError as error:
        return str(error)
    return None


def layout(argv, *flags, tp=None, pp=None) -> list:
    """``argv`` with ``--tensor-model-parallel-size tp --pipeline-model-parallel-size pp`` (where given) and
    then ``flags`` appended, every item a string."""
    sizes = [] if tp is None else ["--tensor-model-parallel-size", tp]
    sizes += [] if pp is None else ["--pipeline-model-parallel-size", pp]
    return list(argv) + [str(f) for f in sizes + list(flags)]


# tiny_argv's model: 2 layers; its longest sum is the loss's softmax over the 512 rows of the padded vocabulary
# (the MLP sums 4 x 64 = 256 terms, a weight gradient the 8 x 32 tokens of a global batch).
TINY_LAYERS, TINY_WIDTH = 2, 512


def assert_same_run(reference, other, label, dtype=torch.float32, num_layers=TINY_LAYERS, width=TINY_WIDTH):
    """``other`` trained as ``reference`` did, computing differently (another layout, schedule or precision):
    as many iterations, and at each the loss and the grad norm within ``run_tolerance`` (relative) of the
    reference's. ``dtype``: the coarser of the two runs' (bf16 where either is). Iterations are numbered
    from ``other["iterations"]`` where it has them (a resumed tail), else from 1."""
    assert reference["losses"] and len(other["losses"]) == len(reference["losses"]), label
    iterations = other.get("iterations") or range(1, len(other["losses"]) + 1)
    for key in ("losses", "grad_norms"):
        for it, a, b in zip(iterations, reference[key], other[key], strict=True):
            rel = run_tolerance(dtype, num_layers, width, it)
            assert abs(a - b) <= rel * abs(a), f"{label}: iteration {it} {key[:-1]} {b} vs {a} ({rel:.2g} relative)"


def assert_continues(straight, tail, label, dtype=None, num_layers=TINY_LAYERS, width=TINY_WIDTH):
    """The losses ``tail`` of a resumed run continue the last ones of ``straight`` (a run's losses from
    iteration 1): bit for bit where ``dtype`` is None (the resume repeats the straight run's operations:
    the same layout), else within ``run_tolerance(dtype, ...)`` (it resumed at another layout)."""
    assert tail and len(tail) <= len(straight), label
    first = len(straight) - len(tail) + 1
    for it, a, b in zip(range(first, len(straight) + 1), straight[-len(tail):], tail, strict=True):
        if dtype is None:
            assert a == b, f"{label}: iteration {it}: loss {b} vs {a} straight (bit for bit)"
        else:
            rel = run_tolerance(dtype, num_layers, width, it)
            assert abs(a - b) <= rel * abs(a), f"{label}: iteration {it}: loss {b} vs {a} straight ({rel:.2g})"


def weights_tolerance(dtype, iterations, max_lr, scale, num_layers=TINY_LAYERS, width=TINY_WIDTH) -> float:
    """How far a weight of two runs that compute differently (``assert_same_run``'s) can be apart after
    ``iterations`` Adam steps of at most ``max_lr``, for weights of size ``scale``: a step moves a weight by lr
    times m / sqrt(v), a ratio of the gradient's running averages whose size is about 1 and which a relative
    difference d of the gradients moves by about d (``run_tolerance``); and each step's addition rounds the two
    runs' weights apart by up to one unit in the last place, eps x scale."""
    return (iterations * max_lr * run_tolerance(dtype, num_layers, width, iterations)
            + iterations * scale * torch.finfo(torch.float32).eps)


def tensorboard_scalars(logdir) -> dict:
    """Every scalar the run logged to tensorboard in ``logdir``: {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def convert_to_universal(tag_dir, output_dir=None, *flags) -> subprocess.CompletedProcess:
    """``tools/convert_checkpoint/ds_to_universal.py`` from the tag folder ``tag_dir`` (CKPT/global_stepN) into
    ``output_dir`` (by default CKPT/global_stepN_universal) with ``flags`` (e.g. ``--target-engine pipeline``), in
    a process of its own; the finished process (text output captured)."""
    output_dir = output_dir or f"{os.path.normpath(tag_dir)}_universal"
    os.makedirs(os.path.dirname(os.path.abspath(output_dir)), exist_ok=True)  # latest_universal goes there
    return subprocess.run([sys.executable, str(DS_TO_UNIVERSAL), "--input_folder", str(tag_dir),
                           "--output_folder", str(output_dir), *map(str, flags)],
                          capture_output=True, text=True, env=dict(os.environ, DS_ACCELERATOR="cpu"))


def to_universal(tag_dir, output_dir=None, *flags) -> str:
    """What ``convert_to_universal`` runs, asserted to succeed and to leave a complete checkpoint; its output
    folder. The script's ``run_tool(main)`` runs in a process of its own forked from ``run_distributed``'s fork
    server, which has imported torch and DeepSpeed already: a new interpreter spends about 4 s importing them,
    for each of the suite's conversions (``convert_to_universal`` still starts the script itself)."""
    import torch.multiprocessing as mp

    from megatron.testing.processes import FORKSERVER_PRELOAD

    output_dir = output_dir or f"{os.path.normpath(tag_dir)}_universal"
    os.makedirs(os.path.dirname(os.path.abspath(output_dir)), exist_ok=True)  # latest_universal goes there
    argv = ["--input_folder", str(tag_dir), "--output_folder", str(output_dir), *map(str, flags)]
    with tempfile.TemporaryDirectory(prefix="ds_to_universal_") as folder:
        log = os.path.join(folder, "output.txt")
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # as run_distributed's ranks (no effect once it runs)
        proc = ctx.Process(target=_run_ds_to_universal, args=(
            argv, dict(os.environ, DS_ACCELERATOR="cpu"), os.getcwd(), log))
        proc.start()
        try:
            proc.join(timeout=600)
        finally:  # also when pytest-timeout interrupts the join
            if proc.is_alive():
                proc.kill()
                proc.join()
        output = open(log, errors="replace").read() if os.path.isfile(log) else "(it wrote no output)"
    assert proc.exitcode == 0, f"exit status {proc.exitcode}\n{output[-6000:]}"
    assert os.path.isfile(os.path.join(output_dir, "complete")), os.listdir(output_dir)
    return str(output_dir)


def _run_ds_to_universal(argv, environ, cwd, log):
    """In a fork of the fork server: ds_to_universal.py's ``__main__`` (``run_tool(main)``, which exits with its
    status) on ``argv``, in the caller's environment and folder, writing its stdout and stderr to ``log``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    # DeepSpeed's converter forks its worker processes (the default start method of a new interpreter on Linux), so
    # that they inherit its safe torch.load; in a fork-server child the default would be the fork server.
    multiprocessing.set_start_method("fork", force=True)
    from megatron.cli import run_tool
    from tools.convert_checkpoint.ds_to_universal import main

    run_tool(lambda: main(argv))
