"""``--async-save`` (megatron.checkpoint.async_save): the checkpoints a background writer makes resume as the
synchronous ones do (their files the same but for the flags' record), the step loop goes on while the writer works,
the next save, the end of training and SIGTERM wait for it, a kill -9 at any moment of its write (state copied but
nothing written; half a file written; every file written and fsynced but no marker; the marker but not ``latest``)
leaves ``latest`` on a complete tag that resumes exactly, a failed write (ENOSPC) stops the run at the next step with
the synchronous save's error, over two ranks ``complete`` is written only once every rank's writer is done, and
ZeRO-3 (DP=2) and MoE experts over EP=2 save in the background and resume exactly.

The one-process runs share one launch (``runs`` below, module-scoped); the killed run is a ``pretrain_gpt.py``
process of its own; the two-rank cases are one launch of 2 processes (``two_ranks``)."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from megatron.testing import run_distributed, tiny_argv
from tests.helpers.faults import held_write_env
from tests.helpers.full_disk import check_failed_save_and_resume, fail_to_save_then_resume
from tests.helpers.paths import REPO_ROOT
from tests.helpers.training import assert_continues, record_run

ITERS, INTERVAL = 6, 2


def _latest(save_dir) -> str:
    with open(os.path.join(save_dir, "latest")) as f:
        return f.read().strip()


def _resume_copy(save_dir, tag, to) -> str:
    """A folder holding only ``tag`` of ``save_dir`` with ``latest`` naming it: a resume from that tag."""
    os.makedirs(to)
    shutil.copytree(os.path.join(save_dir, tag), os.path.join(to, tag))
    with open(os.path.join(to, "latest"), "w") as f:
        f.write(tag)
    return str(to)


def _one_process_runs(rank, world_size, argv, folder, killed, copies):
    """Every one-process run of the module, in one launch (see each test for what it checks)."""
    import threading

    import torch

    import megatron.checkpoint.training_io as training_io
    import megatron.training.loop as loop
    from megatron.arguments import run_config_from_argv
    from megatron.checkpoint.async_save import AsyncSaver, HostCopyWriter
    from megatron.checkpoint.training_io import CheckpointSaveError
    from megatron.training.pretrain import pretrain

    out, events, blocked = {}, [], []
    real = {"save": torch.save, "step": loop.Trainer.train_step, "marker": training_io.write_complete_marker,
            "sync": training_io.save_checkpoint, "async": AsyncSaver.save, "poll": AsyncSaver.poll,
            "wait": AsyncSaver.wait, "copy": HostCopyWriter.save}
    hooks = {"release": threading.Event(), "hold": None, "fail": None, "fail_before": None, "signal_at": None,
             "writer": None}

    def timed(name, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            if name in ("sync", "async") or result is not None:  # a poll or wait that finished a save
                blocked.append((name, time.perf_counter() - start))
            return result
        return call

    def save(obj, f, *args, **kwargs):
        if hooks["hold"] and hooks["hold"] in str(f):
            hooks["release"].wait()  # the writer of this tag, held until the next save is asked for
        if hooks["fail"] and hooks["fail"] in str(f):
            with open(f, "wb") as file:
                file.write(b"\0" * 128)  # what fitted before the disk filled
            raise OSError(28, os.strerror(28), str(f))
        real["save"](obj, f, *args, **kwargs)
        events.append(("written", os.path.basename(os.path.dirname(str(f)))))

    def step(self):
        record = real["step"](self)
        events.append(("step", record.iteration))
        if record.iteration == hooks["fail_before"]:
            assert hooks["writer"].finished.wait(60)  # the writer has failed before this step ends: it stops the run
        if record.iteration == hooks["signal_at"]:
            os.kill(os.getpid(), signal.SIGTERM)
        return record

    def async_save(self, save_dir, iteration, *args, **kwargs):
        events.append(("save", iteration))
        if iteration == 4:
            hooks["release"].set()
        return real["async"](self, save_dir, iteration, *args, **kwargs)

    def marker(tag_dir, text):
        real["marker"](tag_dir, text)
        events.append(("complete", os.path.basename(tag_dir)))

    def copy(self, state_dict, path):
        events.append(("copy", os.path.basename(os.path.dirname(path))))
        hooks["writer"] = self
        real["copy"](self, state_dict, path)

    torch.save, loop.Trainer.train_step, training_io.write_complete_marker = save, step, marker
    training_io.save_checkpoint = timed("sync", real["sync"])
    AsyncSaver.save, AsyncSaver.poll, AsyncSaver.wait = (timed("async", async_save), timed("poll", real["poll"]),
                                                         timed("wait", real["wait"]))
    HostCopyWriter.save = copy

    def run(name, run_argv):
        events.clear()
        blocked.clear()
        rc = run_config_from_argv(run_argv, world_size=world_size)
        try:
            out[name] = dict(record_run(rc, pretrain(rc)), error=None)
        except CheckpointSaveError as error:
            out[name] = {"error": str(error), "iterations": [e[1] for e in events if e[0] == "step"]}
        out[name].update(events=list(events), blocked=list(blocked))

    try:
        sync, async_dir = os.path.join(folder, "sync"), os.path.join(folder, "async")
        run("sync", argv + ["--save", sync])
        hooks["hold"] = "global_step2"  # held until the save of iteration 4 is asked for
        run("async", argv + ["--save", async_dir, "--async-save"])
        hooks["hold"] = None
        run("resumed", argv + ["--async-save", "--save", os.path.join(folder, "resumed"),
                               "--load", _resume_copy(async_dir, "global_step2", os.path.join(folder, "from2"))])
        run("after_kill", argv + ["--async-save", "--save", killed, "--load", killed])
        for moment, copy in copies.items():
            run(f"after_kill_{moment}", argv + ["--async-save", "--save", copy, "--load", copy])
        zero2 = os.path.join(folder, "zero2")  # the model engine (ZeRO-2): its DeepSpeedEngine's checkpoint engine
        run("zero2", argv + ["--zero-stage", "2", "--save", zero2, "--async-save"])
        run("zero2_resumed", argv + ["--zero-stage", "2", "--async-save", "--save", os.path.join(folder, "zero2b"),
                                     "--load", _resume_copy(zero2, "global_step4", os.path.join(folder, "from4"))])
        signalled = os.path.join(folder, "signalled")
        hooks["signal_at"] = 3
        run("signalled", tiny_argv_with(argv, save_interval=100) + ["--save", signalled, "--async-save"])
        hooks["signal_at"] = None
        full = os.path.join(folder, "full")  # the same folder for both: the messages name it, and the same sizes
        hooks["fail"] = "global_step4"
        run("full_sync", argv + ["--save", full])  # stops at the save of 4
        shutil.rmtree(full)
        hooks["fail_before"] = 5
        run("full_async", argv + ["--save", full, "--async-save"])
    finally:
        torch.save, loop.Trainer.train_step, training_io.write_complete_marker = (real["save"], real["step"],
                                                                                  real["marker"])
        training_io.save_checkpoint = real["sync"]
        AsyncSaver.save, AsyncSaver.poll, AsyncSaver.wait = real["async"], real["poll"], real["wait"]
        HostCopyWriter.save = real["copy"]
    return out


def tiny_argv_with(argv, **flags) -> list:
    """``argv`` with each ``--flag value`` of ``flags`` replaced."""
    argv = list(argv)
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        argv[argv.index(flag) + 1] = str(value)
    return argv


# Moments of global_step4's background write at which the writer is held and the --save folder copied: a kill -9
# there leaves exactly these files (SIGKILL ends the process; what it wrote is on the disk, nothing more is), so a
# copy taken while the write is held at that moment is what the kill leaves, and one process serves every moment.
# The last moment, half-way through global_step6's first file, is a real kill -9.
COPIED_AT = ("before-write", "before-complete", "before-latest")


def _kill_during_the_write(argv, folder) -> tuple[str, dict]:
    """``pretrain_gpt.py argv --async-save``: its write of global_step4 held at each of ``COPIED_AT`` in turn (the
    --save folder copied there, then released), its writer then held half-way through global_step6's first file
    and the process killed with SIGKILL; (the --save folder, {moment: its copy})."""
    save, faults = os.path.join(folder, "killed"), os.path.join(folder, "faults")
    holds = [("global_step4", moment) for moment in COPIED_AT] + [("global_step6", "half-file")]
    env = dict(held_write_env(faults, holds), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *argv, "--save", save, "--async-save"],
                            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    copies = {}
    try:
        for tag, moment in holds:
            held, deadline = os.path.join(faults, f"{moment}-{tag}-rank0"), time.time() + 240
            while not os.path.exists(held):
                assert proc.poll() is None, proc.communicate()[0][-3000:]
                assert time.time() < deadline, f"the write of {tag} never reached {moment}"
                time.sleep(0.1)
            if moment == "half-file":
                proc.send_signal(signal.SIGKILL)
                proc.communicate(timeout=60)
                break
            copies[moment] = os.path.join(folder, f"killed-{moment}")
            shutil.copytree(save, copies[moment])
            open(os.path.join(faults, f"release-{moment}-{tag}-rank0"), "w").close()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    return save, copies


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("async_save"))
    argv = tiny_argv(tiny_corpus, train_iters=ITERS, save_interval=INTERVAL)
    killed, copies = _kill_during_the_write(argv, folder)
    left = {moment: _entries(path) for moment, path in dict(copies, killed=killed).items()}  # before the resumes
    (out,) = run_distributed(_one_process_runs, world_size=1, args=(argv, folder, killed, copies), timeout=300)
    return dict(out, folder=folder, left=left)


def _entries(save_dir) -> dict:
    """{"latest": what it names, tag: [the tag folder's files]} of a --save folder."""
    tags = {name: sorted(os.listdir(os.path.join(save_dir, name))) for name in os.listdir(save_dir)
            if os.path.isdir(os.path.join(save_dir, name))}
    return dict(tags, latest=_latest(save_dir))


def _same(a, b, where="") -> None:
    """Equal objects, tensors bit for bit (dtype, shape, values)."""
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}/{i}")
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.multiprocess
def test_an_async_checkpoint_holds_the_synchronous_ones_files_and_resumes_exactly(runs):
    import torch

    sync, asynced = os.path.join(runs["folder"], "sync"), os.path.join(runs["folder"], "async")
    assert runs["async"]["losses"] == runs["sync"]["losses"]  # the same run: saving does not touch the numbers
    for tag in ("global_step2", "global_step4", "global_step6"):
        names = sorted(os.listdir(os.path.join(sync, tag)))
        assert sorted(os.listdir(os.path.join(asynced, tag))) == names and "complete" in names
        for name in names:
            a, b = os.path.join(sync, tag, name), os.path.join(asynced, tag, name)
            if name.startswith("mp_rank_"):  # the flags' record ('args') holds --save and --async-save
                x, y = (torch.load(p, map_location="cpu", weights_only=False) for p in (a, b))
                assert vars(y.pop("args")) == dict(vars(x.pop("args")), save=asynced, async_save=True)
                _same(x, y, name)
            elif name != "checksums.json":  # the mp_rank file's digest differs with it
                with open(a, "rb") as fa, open(b, "rb") as fb:
                    assert fa.read() == fb.read(), f"{tag}/{name}"
    from megatron.checkpoint.integrity import verify_checksums

    assert verify_checksums(os.path.join(asynced, "global_step4"), distributed=False) == []
    assert _latest(asynced) == "global_step6"
    resumed = runs["resumed"]
    assert resumed["iterations"] == [3, 4, 5, 6]
    assert_continues(runs["sync"]["losses"], resumed["losses"], "resumed from an async-saved global_step2")
    timings = {name: [f"{seconds * 1000:.1f} ms" for kind, seconds in runs[name]["blocked"] if kind == k]
               for name, k in (("sync", "sync"), ("async", "async"))}
    finishes = [f"{kind} {seconds * 1000:.1f} ms" for kind, seconds in runs["async"]["blocked"] if kind != "async"]
    print(f"\nthe step loop blocked per save (tiny model, saves at 2, 4, 6; the async save of 4 waited for the held "
          f"writer of 2): synchronous {timings['sync']}, asynchronous {timings['async']}; the async saves' "
          f"finishing (checksums.json, run_state.json, marker, latest): {finishes}")


@pytest.mark.multiprocess
def test_a_zero2_async_checkpoint_resumes_exactly(runs):
    zero2, resumed = runs["zero2"], runs["zero2_resumed"]
    assert zero2["engine"] == "ModelEngine" and zero2["engine_stage"] == 2, zero2["engine"]
    assert _latest(os.path.join(runs["folder"], "zero2")) == "global_step6"
    assert resumed["iterations"] == [5, 6]
    assert_continues(zero2["losses"], resumed["losses"], "ZeRO-2 resumed from an async-saved global_step4")


@pytest.mark.multiprocess
def test_the_step_loop_goes_on_and_the_next_save_and_the_end_wait_for_the_writer(runs):
    events = runs["async"]["events"]
    first = events.index(("copy", "global_step2"))
    written_2 = max(i for i, e in enumerate(events) if e == ("written", "global_step2"))
    # the writer of global_step2 is held: iteration 3 trains while it writes ...
    assert first < events.index(("step", 3)) < events.index(("save", 4)) < written_2
    # ... and the save of 4 waits for it, finishes it (marker, latest) before copying its own state
    assert written_2 < events.index(("complete", "global_step2")) < events.index(("copy", "global_step4"))
    # the save of 6 is the last thing of the run: the end of training waited for it (no step after it polled)
    assert events[-1] == ("complete", "global_step6"), events[-4:]
    assert _latest(os.path.join(runs["folder"], "async")) == "global_step6"
    # SIGTERM at iteration 3: the run saves (in the background), waits for the writer, and leaves
    signalled = runs["signalled"]
    assert (signalled["reason"], signalled["iteration"]) == ("signal", 3)
    assert signalled["events"][-1] == ("complete", "global_step3")
    assert _latest(os.path.join(runs["folder"], "signalled")) == "global_step3"


@pytest.mark.multiprocess
def test_a_kill_during_the_background_write_leaves_latest_on_the_previous_checkpoint(runs):
    left = runs["left"]["killed"]
    assert left["latest"] == "global_step4" and "complete" in left["global_step4"]
    assert "global_step6" in left and "complete" not in left["global_step6"], left  # held half-way
    after = runs["after_kill"]
    assert after["iterations"] == [5, 6]  # --load = --save: resumed from global_step4 ...
    assert_continues(runs["sync"]["losses"], after["losses"], "resumed after a kill -9 during the write")  # exactly


@pytest.mark.multiprocess
@pytest.mark.parametrize("moment", COPIED_AT)
def test_a_kill_at_any_moment_of_the_background_write_leaves_latest_on_a_complete_checkpoint(runs, moment):
    """Killed (the folder as the kill leaves it, see COPIED_AT) with global_step4's state copied to host memory but
    no file written, with every file written and fsynced but no marker, or with the marker but ``latest`` not
    moved: ``latest`` names global_step2, complete, and the run resumes from it loss for loss."""
    left = runs["left"][moment]
    assert left["latest"] == "global_step2" and "complete" in left["global_step2"], left
    written = left.get("global_step4", [])
    if moment == "before-write":
        assert not [name for name in written if name.endswith(".pt")], written
    else:  # every file the finished global_step4 of the killed run holds; the marker only before-latest
        finished = runs["left"]["killed"]["global_step4"]
        assert written == [name for name in finished if name != "complete" or moment == "before-latest"], written
    after = runs[f"after_kill_{moment}"]
    assert after["iterations"] == [3, 4, 5, 6], after["iterations"]  # from global_step2 ...
    assert_continues(runs["sync"]["losses"], after["losses"], f"resumed after a kill -9 {moment}")  # exactly


@pytest.mark.multiprocess
def test_a_failed_background_write_stops_the_run_at_the_next_step_with_the_synchronous_error(runs):
    full = os.path.join(runs["folder"], "full")
    sync_error, async_run = runs["full_sync"]["error"], runs["full_async"]
    assert sync_error is not None and async_run["error"] is not None
    assert sync_error.startswith(f"saving {full}/global_step4 failed: no space left on device (ENOSPC); ")

    def free_bytes_aside(message):  # the free space is measured at the failure
        return re.sub(r"; \d+ bytes free in ", "; N bytes free in ", message)

    assert free_bytes_aside(async_run["error"]) == free_bytes_aside(sync_error)
    assert async_run["iterations"] == [1, 2, 3, 4, 5]  # the write of 4 failed during 5: stopped after it
    assert _latest(full) == "global_step2" and not os.path.exists(os.path.join(full, "global_step4"))


def _two_ranks(rank, world_size, argv, log, layouts, folder):
    """The ENOSPC of rank 1's writer agreed by both ranks (tests.helpers.full_disk's run and resume, with
    --async-save); in the resumed run rank 1's writer is slow, and the order of the writes and the marker logged.
    Then each of ``layouts`` ({name: argv}) trains with --async-save, saving every 2 iterations, and resumes from
    its global_step2: (the failure's record, {name: (the run's record, the resumed run's record)})."""
    import torch
    import torch.distributed as dist

    import megatron.checkpoint.training_io as training_io
    from tests.helpers.training import train

    real_save, real_marker = torch.save, training_io.write_complete_marker

    def save(obj, f, *args, **kwargs):
        if rank == 1:
            time.sleep(0.5)  # a slow disk on rank 1: the marker must still wait for this file
        real_save(obj, f, *args, **kwargs)
        with open(log, "a") as out:
            out.write(f"written {rank} {f}\n")

    def marker(tag_dir, text):
        with open(log, "a") as out:
            out.write(f"complete {tag_dir}\n")
        real_marker(tag_dir, text)

    torch.save, training_io.write_complete_marker = save, marker
    try:
        failed = fail_to_save_then_resume(rank, world_size, argv, 1)
    finally:
        torch.save, training_io.write_complete_marker = real_save, real_marker
    resumed = {}
    for name, layout_argv in layouts.items():
        save_dir = os.path.join(folder, name)
        (straight,) = train(rank, world_size, [layout_argv + ["--async-save", "--save", save_dir]])
        if rank == 0:
            _resume_copy(save_dir, "global_step2", os.path.join(folder, f"{name}-from2"))
        dist.barrier()
        (tail,) = train(rank, world_size, [layout_argv + ["--async-save", "--save", os.path.join(folder, f"{name}-b"),
                                                          "--load", os.path.join(folder, f"{name}-from2")]])
        resumed[name] = (straight, tail, _latest(save_dir), sorted(os.listdir(os.path.join(save_dir, "global_step2"))))
    return failed, resumed


TWO_RANK_LAYOUTS = {  # --async-save over two ranks: ZeRO-3's partitioned parameters, MoE experts split over EP=2
    "zero3": ["--zero-stage", "3"],
    "ep2": ["--num-experts", "4", "--expert-model-parallel-size", "2"],  # ZeRO-0 (ZeRO-3 refuses EP > 1)
}


@pytest.fixture(scope="module")
def two_ranks(tiny_corpus, tmp_path_factory):
    folder = tmp_path_factory.mktemp("async_two_ranks")
    save, log = folder / "ckpt", folder / "order.log"
    argv = tiny_argv(tiny_corpus, "--zero-stage", "1", "--async-save", train_iters=4, save=str(save), save_interval=2)
    layouts = {name: tiny_argv(tiny_corpus, *flags, train_iters=4, save_interval=2)
               for name, flags in TWO_RANK_LAYOUTS.items()}
    (failed, resumed), (failed_1, _) = run_distributed(_two_ranks, world_size=2,
                                                       args=(argv, str(log), layouts, str(folder)), timeout=300)
    return dict(save=save, log=log, failed=[failed, failed_1], resumed=resumed)


@pytest.mark.multiprocess
def test_two_ranks_agree_on_a_failed_write_and_mark_complete_after_every_ranks_files(two_ranks):
    save = two_ranks["save"]
    check_failed_save_and_resume(str(save), two_ranks["failed"])  # the synchronous save's checks, message and resume
    lines = two_ranks["log"].read_text().splitlines()
    complete = lines.index(f"complete {save / 'global_step4'}")  # the resumed run's save of 4
    rank_1 = [i for i, line in enumerate(lines) if line.startswith("written 1 ") and "global_step4" in line]
    assert rank_1 and max(rank_1) < complete, lines  # rank 1's optimizer shard was durable before the marker
    assert _latest(save) == "global_step4"


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", TWO_RANK_LAYOUTS)
def test_zero3_and_expert_parallel_async_checkpoints_resume_exactly(two_ranks, layout):
    straight, tail, latest, files = two_ranks["resumed"][layout]
    if layout == "zero3":  # each rank's parameter and optimizer partitions, by the writer threads
        assert straight["engine_stage"] == 3, straight["engine"]
        assert {"zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= set(files)
    else:  # each EP rank's experts, written beside the engine's files
        assert {"expert_states_ep_00_tp_00_pp_00.pt", "expert_states_ep_01_tp_00_pp_00.pt"} <= set(files), files
    assert latest == "global_step4" and tail["iterations"] == [3, 4]
    assert_continues(straight["losses"], tail["losses"], f"{layout}: resumed from an async-saved global_step2")


def test_host_copy_keeps_what_is_shared_and_later_steps_do_not_change_it():
    import io

    import torch

    from megatron.checkpoint.async_save import host_copy

    base, weight = torch.arange(12.0), torch.nn.Parameter(torch.ones(3))
    shared_list = [1, "two"]
    state = {"view": base[2:6], "whole": base.view(3, 4), "weight": weight, "step": torch.tensor(3),
             "nested": [shared_list, {"again": shared_list}], "betas": (0.9, 0.95)}
    state["same"] = state["view"]
    saved = io.BytesIO()
    torch.save(state, saved)  # the zip format, DeepSpeed's here (the legacy one names storages by address)
    copied = host_copy(state)
    base.add_(100.0)  # the optimizer steps after the copy: in place
    with torch.no_grad():
        weight.mul_(5.0)
    assert copied["view"].tolist() == [2.0, 3.0, 4.0, 5.0] and copied["weight"].tolist() == [1.0, 1.0, 1.0]
    assert copied["same"] is copied["view"] and copied["nested"][0] is copied["nested"][1]["again"]
    assert copied["view"].untyped_storage().data_ptr() == copied["whole"].untyped_storage().data_ptr()
    assert isinstance(copied["weight"], torch.nn.Parameter) and copied["weight"].requires_grad
    buffer = io.BytesIO()
    torch.save(copied, buffer)
    assert buffer.getvalue() == saved.getvalue()  # the file a synchronous save would have written, byte for byte
    # the next save's copy goes into the written copy's host buffers (a pool, as HostCopyWriter keeps), with the
    # state as it is now, and saves to the same bytes as the state itself
    memo, pool = {"deepcopy": {}}, {}
    first = host_copy(state, memo, pool)
    for host, pinned in memo["buffers"]:
        pool.setdefault((host.numel(), pinned), []).append(host)
    reused = {host.data_ptr() for host, _ in memo["buffers"]}
    del first
    base.sub_(50.0)
    again_memo = {"deepcopy": {}}
    again = host_copy(state, again_memo, pool)
    assert {host.data_ptr() for host, _ in again_memo["buffers"]} == reused and not any(pool.values())
    assert again["view"].tolist() == [52.0, 53.0, 54.0, 55.0] and again["weight"].tolist() == [5.0] * 3
    expected, got = io.BytesIO(), io.BytesIO()
    torch.save(state, expected)
    torch.save(again, got)
    assert got.getvalue() == expected.getvalue()


def test_async_save_needs_save(tiny_corpus):
    from megatron.arguments import run_config_from_argv

    with pytest.raises(ValueError, match="--async-save writes the --save checkpoints in the background"):
        run_config_from_argv(tiny_argv(tiny_corpus, "--async-save"), world_size=1)


def test_any_failure_of_the_writer_thread_fails_the_save(tmp_path):
    import torch

    from megatron.checkpoint.async_save import HostCopyWriter

    class Unpicklable:  # a writer that fails with something other than an OSError
        def save(self, state_dict, path):
            raise TypeError(f"cannot pickle {path}")

    writer = HostCopyWriter(Unpicklable())
    writer.save({"weight": torch.ones(2)}, str(tmp_path / "file.pt"))
    writer.start()
    assert isinstance(writer.join(), TypeError) and writer.done() and not writer.digests
