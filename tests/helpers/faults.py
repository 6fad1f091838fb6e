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

    held_write_env(tmp_path, [("global_step4", "half-file")])  each rank of the subprocess, in its first
                                          ``torch.save`` of a file of that tag, writes half the file, then
                                          ``tmp_path/half-file-global_step4-rank<RANK>``, and waits for ever (for
                                          the kill); --async-save's writer thread is held so while the step loop
                                          goes on. Other moments ("before-write", "before-complete",
                                          "before-latest") wait for a release file instead (``hold_write``)

A test of in-job restart loses a rank at a chosen point instead of racing it:

    kill_env(tmp_path, 1, 5)              rank 1 of a torchrun job kills itself (SIGKILL) once iteration 5's step
                                          is done, in the first attempt (``attempts``); ``moment="save"``: once the
                                          save of iteration 5 has returned (marker and ``latest`` written);
                                          ``more``: further kills, e.g. one in the restarted attempt

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
HOLD_WRITE_ENV = "MEGATRON_TEST_HOLD_WRITE"  # "global_step4/half-file,...:/folder": what to hold, where to say it
SLOW_ENV = "MEGATRON_TEST_SLOW_FORWARD"  # "1:0.1": the rank, then the seconds slept in each forward call
KILL_ENV = "MEGATRON_TEST_KILL_AFTER"  # "1:5:0,1:step;...": the rank, iteration, attempts it dies in, when
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


WRITE_MOMENTS = ("before-write", "half-file", "before-complete", "before-latest")


def hold_write(holds, folder) -> None:
    """Hold this process's checkpoint writes of ``holds`` ([(tag, moment)], moments in ``WRITE_MOMENTS``), once
    each: "before-write", the first ``torch.save`` of the tag, before it writes anything (the state is copied to
    host memory by then); "half-file", the same call once half its bytes are written, held for ever (for the kill);
    "before-complete", every file of the tag written and fsynced, ``checksums.json`` and ``run_state.json`` too,
    before the ``complete`` marker; "before-latest", after the marker, before ``latest`` moves. At each, writes
    ``folder/<moment>-<tag>-rank<RANK>`` and waits until ``folder/release-<moment>-<tag>-rank<RANK>`` exists
    (``held_write_env``). --async-save's writer thread is held so while the step loop goes on (the first two)."""
    import io

    import torch

    import megatron.checkpoint.training_io as training_io

    folder, rank, wanted = pathlib.Path(folder), os.environ.get("RANK", "0"), set(holds)
    assert all(moment in WRITE_MOMENTS for _, moment in wanted), holds

    def hold(tag, moment):
        if (tag, moment) in wanted:
            wanted.discard((tag, moment))
            (folder / f"{moment}-{tag}-rank{rank}").touch()
            while not (folder / f"release-{moment}-{tag}-rank{rank}").exists():
                time.sleep(0.05)

    real_save, real_marker = torch.save, training_io.write_complete_marker

    def save(obj, f, *args, **kwargs):
        tag = os.path.basename(os.path.dirname(str(f)))
        hold(tag, "before-write")
        if (tag, "half-file") not in wanted:
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        with open(f, "wb") as out:
            out.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        (folder / f"half-file-{tag}-rank{rank}").touch()
        while True:
            time.sleep(1)

    def marker(tag_dir, text):
        tag = os.path.basename(tag_dir)
        hold(tag, "before-complete")
        real_marker(tag_dir, text)
        hold(tag, "before-latest")

    torch.save, training_io.write_complete_marker = save, marker


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


def kill_after(rank: int, iteration: int, attempts: set, moment: str = "step") -> None:
    """On ``rank``, in the torchrun attempts ``attempts`` (TORCHELASTIC_RESTART_COUNT; 0 the first), the process
    kills itself (SIGKILL: a lost rank, nothing cleaned up) once ``iteration``'s step is done (``moment`` "step":
    ``Trainer.train_step`` patched), or once the synchronous save of ``iteration`` has returned (``moment`` "save":
    ``training_io.save_checkpoint`` patched; every rank's files, the marker and ``latest`` are then written)
    (``kill_env``)."""
    import megatron.checkpoint.training_io as training_io
    from megatron.training.loop import Trainer

    if int(os.environ.get("RANK", "0")) != rank or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) not in attempts:
        return
    if moment == "save":
        save_checkpoint = training_io.save_checkpoint

        def killed_after_save(engine, save_dir, at, *args, **kwargs):
            tag = save_checkpoint(engine, save_dir, at, *args, **kwargs)
            if at == iteration:
                os.kill(os.getpid(), signal.SIGKILL)
            return tag

        training_io.save_checkpoint = killed_after_save
        return
    train_step = Trainer.train_step

    def killed(self):
        record = train_step(self)
        if self.progress.iteration == iteration:
            os.kill(os.getpid(), signal.SIGKILL)
        return record

    Trainer.train_step = killed


def kill_env(folder, rank: int, iteration: int, attempts=(0,), moment: str = "step", more=()) -> dict:
    """``os.environ`` plus what makes ``rank`` of a subprocess (a torchrun job) started with it kill itself after
    ``iteration``'s step (``moment`` "step") or save ("save") in each of the torchrun ``attempts``
    (``kill_after``); ``more``: further kills, each (rank, iteration, attempts, moment)."""
    kills = [(rank, iteration, attempts, moment), *more]
    return _installing_env(folder, {KILL_ENV: ";".join(f"{r}:{i}:{','.join(map(str, a))}:{m}" for r, i, a, m in kills)})


def paused_env(folder, iteration: int) -> dict:
    """``os.environ`` plus what makes each rank of a subprocess started with it call ``pause_after(iteration,
    folder)`` at start-up (``folder`` must be seen by every node: the shared folder)."""
    return _installing_env(folder, {PAUSE_ENV: f"{iteration}:{pathlib.Path(folder).resolve()}"})


def held_write_env(folder, holds) -> dict:
    """``os.environ`` plus what makes each rank of a subprocess started with it call ``hold_write(holds, folder)``
    at start-up (``holds``: [(tag, moment)])."""
    spec = ",".join(f"{tag}/{moment}" for tag, moment in holds)
    return _installing_env(folder, {HOLD_WRITE_ENV: f"{spec}:{pathlib.Path(folder).resolve()}"})


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
    ``MEGATRON_TEST_HOLD_WRITE`` ("global_step4/half-file:/folder"), ``MEGATRON_TEST_SLOW_FORWARD`` ("1:0.1"),
    ``MEGATRON_TEST_KILL_AFTER`` ("1:5:0:step") and ``MEGATRON_TEST_PAUSE_AFTER`` ("5:/folder") ask for
    (the sitecustomize's call)."""
    if os.environ.get(ENV):
        iterations, value = os.environ[ENV].split(":")
        poison_gradients({int(i) for i in iterations.split(",")}, float(value))
    if os.environ.get(HOLD_ENV):
        iteration, folder = os.environ[HOLD_ENV].split(":", 1)
        hold_after(int(iteration), folder)
    if os.environ.get(HOLD_WRITE_ENV):
        spec, folder = os.environ[HOLD_WRITE_ENV].split(":", 1)
        hold_write([tuple(hold.split("/")) for hold in spec.split(",")], folder)
    if os.environ.get(SLOW_ENV):
        rank, seconds = os.environ[SLOW_ENV].split(":")
        slow_forward(int(rank), float(seconds))
    if os.environ.get(KILL_ENV):
        for kill in os.environ[KILL_ENV].split(";"):
            rank, iteration, attempts, moment = kill.split(":")
            kill_after(int(rank), int(iteration), {int(a) for a in attempts.split(",")}, moment)
    if os.environ.get(PAUSE_ENV):
        iteration, folder = os.environ[PAUSE_ENV].split(":", 1)
        pause_after(int(iteration), folder)
