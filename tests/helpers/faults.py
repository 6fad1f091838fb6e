"""Faults injected on purpose, so a test of a guard tests the guard and not the CPU.

Whether a learning rate of 1e4 overflows a bf16 gradient, or 1e9 turns an fp32 loss into NaN, and at which
iteration, depends on the kernels one CPU kind happens to run (an AVX-512 machine skipped no step where an
AMX one did). A test that needs a non-finite gradient makes one instead:

    poison_gradients({3}, math.inf)       in a rank (a run_distributed target): from now on in this process,
                                          iteration 3's backward makes one gradient element inf
    poisoned_env(tmp_path, {3}, "nan")    the environment of a subprocess (pretrain_gpt.py) doing the same:
                                          a sitecustomize in ``tmp_path`` installs it at start-up

The element is the first of the first trainable parameter the engine holds (on this rank's pipeline stage),
set in every micro-batch's gradient of the chosen iterations, before DeepSpeed accumulates it.

A test of how promptly a signal stops a run holds the run instead of racing it:

    held_env(tmp_path, 3)                 each rank of the subprocess, once iteration 3's step is done, writes
                                          ``tmp_path/held-rank<RANK>`` and waits until a signal reached it;
                                          the signal so arrives inside iteration 3 on every rank, whatever the
                                          machine's speed, and the run must stop and save at iteration 3

A test of a kill during a checkpoint write holds the write instead of racing it:

    held_write_env(tmp_path, "global_step4")  each rank of the subprocess, in its first ``torch.save`` of a file
                                          of that tag, writes half the file, then ``tmp_path/writing-rank<RANK>``,
                                          and waits for ever (for the kill); --async-save's writer thread is held
                                          so while the step loop goes on

A test of a node lost mid-run (tests/launch/test_multinode.py) pauses the run where the node is lost:

    paused_env(tmp_path, 5)               each rank of the subprocess, once iteration 5's step is done, writes
                                          ``tmp_path/paused-rank<RANK>`` and waits until ``tmp_path/go`` exists;
                                          a node killed or cut off meanwhile is lost inside iteration 6 on every
                                          rank, whatever the machine's speed

A test of --log-straggler slows one rank instead of racing the machine's load:

    slow_forward_env(tmp_path, 1, 0.1)    rank 1 of the subprocess sleeps 0.1 s in each forward call of its model
                                          (inside the forward that --log-straggler times)
"""

import os
import pathlib
import signal
import time

from tests.helpers.paths import REPO_ROOT

ENV = "MEGATRON_TEST_POISON_GRADIENTS"  # "3,4:nan": the iterations, then the value
HOLD_ENV = "MEGATRON_TEST_HOLD_AFTER"  # "3:/folder": the iteration, then where to say "held"
HOLD_WRITE_ENV = "MEGATRON_TEST_HOLD_WRITE"  # "global_step4:/folder": the tag, then where to say "writing"
SLOW_ENV = "MEGATRON_TEST_SLOW_FORWARD"  # "1:0.1": the rank, then the seconds slept in each forward call
KILL_ENV = "MEGATRON_TEST_KILL_AFTER"  # "1:5:0,1": the rank, the iteration, the torchrun attempts it dies in
PAUSE_ENV = "MEGATRON_TEST_PAUSE_AFTER"  # "5:/folder": the iteration, then where to say "paused" and wait for "go"


def poison_gradients(iterations, value: float):
    """Patch ``Trainer.train_step`` in this process: during each of ``iterations`` (1-based), one gradient
    element becomes ``value``. Returns a function that undoes the patch."""
    from megatron.training.loop import Trainer

    iterations = set(iterations)
    train_step = Trainer.train_step

    def poisoned(self):
        if self.progress.iteration + 1 not in iterations:
            return train_step(self)
        param = next(p for p in self.engine.module.parameters() if p.requires_grad)
        handle = param.register_hook(lambda grad: _with_first_element(grad, value))
        try:
            return train_step(self)
        finally:
            handle.remove()

    Trainer.train_step = poisoned
    return lambda: setattr(Trainer, "train_step", train_step)


def _with_first_element(grad, value):
    grad = grad.clone()
    grad.view(-1)[0] = value
    return grad


def hold_after(iteration: int, folder) -> None:
    """Patch ``Trainer.train_step`` in this process: once ``iteration``'s step is done, write
    ``folder/held-rank<RANK>`` and wait until a signal reached the run's exit monitor (``held_env``)."""
    from megatron.training.loop import Trainer

    train_step = Trainer.train_step

    def held(self):
        record = train_step(self)
        if self.progress.iteration == iteration:
            (pathlib.Path(folder) / f"held-rank{os.environ.get('RANK', '0')}").touch()
            while self.exit_monitor.received_signal is None:  # the handler runs between these sleeps
                time.sleep(0.05)
        return record

    Trainer.train_step = held


def hold_write(tag: str, folder) -> None:
    """Patch ``torch.save`` in this process: the first file of ``tag`` gets half its bytes, then
    ``folder/writing-rank<RANK>`` is written and the caller waits for ever (``held_write_env``)."""
    import io

    import torch

    real_save = torch.save

    def held(obj, f, *args, **kwargs):
        if tag not in str(f):
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        with open(f, "wb") as out:
            out.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        (pathlib.Path(folder) / f"writing-rank{os.environ.get('RANK', '0')}").touch()
        while True:
            time.sleep(1)

    torch.save = held


def slow_forward(rank: int, seconds: float) -> None:
    """Patch ``Trainer._setup_instruments`` in this process: on rank ``rank``, each forward call of the engine's
    module sleeps ``seconds`` first (a hook registered after --log-straggler's timer, so inside its time)."""
    from megatron.training.loop import Trainer

    if int(os.environ.get("RANK", "0")) != rank:
        return
    setup = Trainer._setup_instruments

    def slowed(self):
        setup(self)
        self.engine.module.register_forward_pre_hook(lambda module, inputs: time.sleep(seconds))

    Trainer._setup_instruments = slowed


def pause_after(iteration: int, folder) -> None:
    """Patch ``Trainer.train_step`` in this process: once ``iteration``'s step is done, write
    ``folder/paused-rank<RANK>`` and wait until ``folder/go`` exists (``paused_env``)."""
    from megatron.training.loop import Trainer

    train_step = Trainer.train_step
    folder = pathlib.Path(folder)

    def paused(self):
        record = train_step(self)
        if self.progress.iteration == iteration:
            (folder / f"paused-rank{os.environ.get('RANK', '0')}").touch()
            while not (folder / "go").exists():
                time.sleep(0.05)
        return record

    Trainer.train_step = paused


def poisoned_env(folder, iterations, value: str) -> dict:
    """``os.environ`` plus what makes a Python subprocess started with it call ``poison_gradients(iterations,
    float(value))`` at start-up: a ``sitecustomize.py`` written to ``folder``, first on PYTHONPATH."""
    return _installing_env(folder, {ENV: f"{','.join(map(str, sorted(iterations)))}:{value}"})


def held_env(folder, iteration: int) -> dict:
    """``os.environ`` plus what makes each rank of a subprocess started with it call ``hold_after(iteration,
    folder)`` at start-up."""
    return _installing_env(folder, {HOLD_ENV: f"{iteration}:{pathlib.Path(folder).resolve()}"})


def kill_after(rank: int, iteration: int, attempts: set) -> None:
    """Patch ``Trainer.train_step`` in this process: on ``rank``, in the torchrun attempts ``attempts``
    (TORCHELASTIC_RESTART_COUNT; 0 the first), the process kills itself (SIGKILL: a lost rank, nothing cleaned up)
    once ``iteration``'s step is done (``kill_env``)."""
    from megatron.training.loop import Trainer

    if int(os.environ.get("RANK", "0")) != rank or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) not in attempts:
        return
    train_step = Trainer.train_step

    def killed(self):
        record = train_step(self)
        if self.progress.iteration == iteration:
            os.kill(os.getpid(), signal.SIGKILL)
        return record

    Trainer.train_step = killed


def kill_env(folder, rank: int, iteration: int, attempts=(0,)) -> dict:
    """``os.environ`` plus what makes ``rank`` of a subprocess (a torchrun job) started with it kill itself after
    ``iteration``'s step in each of the torchrun ``attempts`` (``kill_after``)."""
    return _installing_env(folder, {KILL_ENV: f"{rank}:{iteration}:{','.join(map(str, attempts))}"})


def paused_env(folder, iteration: int) -> dict:
    """``os.environ`` plus what makes each rank of a subprocess started with it call ``pause_after(iteration,
    folder)`` at start-up (``folder`` must be seen by every node: the shared folder)."""
    return _installing_env(folder, {PAUSE_ENV: f"{iteration}:{pathlib.Path(folder).resolve()}"})


def held_write_env(folder, tag: str) -> dict:
    """``os.environ`` plus what makes each rank of a subprocess started with it call ``hold_write(tag, folder)``
    at start-up."""
    return _installing_env(folder, {HOLD_WRITE_ENV: f"{tag}:{pathlib.Path(folder).resolve()}"})


def slow_forward_env(folder, rank: int, seconds: float) -> dict:
    """``os.environ`` plus what makes a subprocess started with it call ``slow_forward(rank, seconds)`` at
    start-up."""
    return _installing_env(folder, {SLOW_ENV: f"{rank}:{seconds}"})


def _installing_env(folder, variables: dict) -> dict:
    """``os.environ`` with ``variables`` and a ``sitecustomize.py`` in ``folder``, first on PYTHONPATH, that
    installs what they ask for at a Python subprocess's start-up (``install_from_env``)."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import os\n"
        f"if any(os.environ.get(name) for name in {(ENV, HOLD_ENV, HOLD_WRITE_ENV, SLOW_ENV, KILL_ENV, PAUSE_ENV)!r}):\n"
        "    from tests.helpers.faults import install_from_env\n"
        "    install_from_env()\n")
    path = os.pathsep.join([str(folder), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return dict(os.environ, PYTHONPATH=path, **variables)


def install_from_env() -> None:
    """What ``MEGATRON_TEST_POISON_GRADIENTS`` ("3,4:nan"), ``MEGATRON_TEST_HOLD_AFTER`` ("3:/folder"),
    ``MEGATRON_TEST_HOLD_WRITE`` ("global_step4:/folder"), ``MEGATRON_TEST_SLOW_FORWARD`` ("1:0.1") and
    ``MEGATRON_TEST_KILL_AFTER`` ("1:5:0") and ``MEGATRON_TEST_PAUSE_AFTER`` ("5:/folder") ask for
    (the sitecustomize's call)."""
    if os.environ.get(ENV):
        iterations, value = os.environ[ENV].split(":")
        poison_gradients({int(i) for i in iterations.split(",")}, float(value))
    if os.environ.get(HOLD_ENV):
        iteration, folder = os.environ[HOLD_ENV].split(":", 1)
        hold_after(int(iteration), folder)
    if os.environ.get(HOLD_WRITE_ENV):
        tag, folder = os.environ[HOLD_WRITE_ENV].split(":", 1)
        hold_write(tag, folder)
    if os.environ.get(SLOW_ENV):
        rank, seconds = os.environ[SLOW_ENV].split(":")
        slow_forward(int(rank), float(seconds))
    if os.environ.get(KILL_ENV):
        rank, iteration, attempts = os.environ[KILL_ENV].split(":")
        kill_after(int(rank), int(iteration), {int(a) for a in attempts.split(",")})
    if os.environ.get(PAUSE_ENV):
        iteration, folder = os.environ[PAUSE_ENV].split(":", 1)
        pause_after(int(iteration), folder)
