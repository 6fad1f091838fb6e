"""What a checkpoint save costs the training loop, synchronous against ``--async-save``, side by side in one run, on
a model of about 1 GB of state; and the synchronous save's throughput against the disk's sequential write bandwidth
measured in the same run, in the same folder.

    python -m benchmarks.bench_checkpoint --output benchmarks/results/checkpoint_<date>.json
    python -m benchmarks.bench_checkpoint --hidden-size 512 --num-layers 8     # a smaller model

One process (fp32, the pipeline engine, Adam: 12 bytes of state per parameter; the default 7 layers of hidden 1024
hold 88M parameters, a 1.06 GB checkpoint), ``--train-iters`` iterations saving every ``--save-interval``, once
without and once with ``--async-save``. Per save, the seconds the step loop was blocked:

    sync    in ``training_io.save_checkpoint``: every file written, fsynced, hashed, ``complete`` and ``latest``
    async   in ``AsyncSaver.save`` (the state copied to host memory), and the ``poll`` after a later step that
            finished it (``complete``, ``latest``): the writing itself runs in a thread while the loop trains.
            Reported apart: each ``wait``, where the loop waited for the writer (the next save came before the
            write was done, or the end of training)

``disk``: one file of the checkpoint's size written sequentially in 16 MiB blocks and fsynced, before the runs.
Reported: the median blocked seconds per save and mode, async (copy + finish) / sync (the issue's goal: at most
10%; --save-interval must leave the writer time to finish, as real intervals of hundreds of iterations do), the
checkpoint's bytes over the synchronous save's median (its throughput) against the disk's bandwidth (goal: at least
70%), the folder's filesystem. The figures are this machine's: on a GPU node the host copy is a device-to-host
transfer into pinned memory, and the disk a parallel filesystem. Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from benchmarks._common import emit, machine, tiny_argv, tiny_corpus

BLOCK = 16 * 1024 * 1024


def _filesystem(path: str) -> str:
    """The type of the filesystem ``path`` lies on (from /proc/mounts: the longest mount point above it)."""
    path, best = os.path.realpath(path), ("", "unknown")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, point, kind = line.split()[:3]
                if path.startswith(point.rstrip("/") + "/") or path == point:
                    if len(point) > len(best[0]):
                        best = (point, kind)
    except OSError:
        pass
    return best[1]


def disk_bandwidth(folder: str, nbytes: int) -> float:
    """Bytes per second of one sequential write of ``nbytes`` to a new file in ``folder``, fsynced."""
    block = os.urandom(BLOCK)
    path = os.path.join(folder, "bandwidth.bin")
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = 0
        while written < nbytes:
            written += os.write(fd, block[:min(BLOCK, nbytes - written)])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    os.remove(path)
    return nbytes / seconds


def _tag_bytes(save_dir: str, tag: str) -> int:
    root = os.path.join(save_dir, tag)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def _runs(rank, world_size, argv, folder):
    """Both runs in this process: {mode: {"blocked": [(kind, seconds)], "tag_bytes": int}}."""
    import megatron.checkpoint.training_io as training_io
    from megatron.arguments import run_config_from_argv
    from megatron.checkpoint.async_save import AsyncSaver
    from megatron.training.pretrain import pretrain

    blocked = []
    real = {"sync": training_io.save_checkpoint, "async": AsyncSaver.save, "poll": AsyncSaver.poll,
            "wait": AsyncSaver.wait}

    def timed(kind, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            if kind in ("sync", "async") or result is not None:  # a poll or wait that finished a save
                blocked.append((kind, time.perf_counter() - start))
            return result
        return call

    training_io.save_checkpoint = timed("sync", real["sync"])
    AsyncSaver.save, AsyncSaver.poll, AsyncSaver.wait = (timed("async", real["async"]), timed("poll", real["poll"]),
                                                         timed("wait", real["wait"]))
    out = {}
    try:
        for mode, extra in (("sync", []), ("async", ["--async-save"])):
            save = os.path.join(folder, mode)
            blocked.clear()
            pretrain(run_config_from_argv(argv + ["--save", save] + extra, world_size=world_size))
            with open(os.path.join(save, "latest")) as f:
                tag = f.read().strip()
            out[mode] = {"blocked": list(blocked), "tag_bytes": _tag_bytes(save, tag)}
            shutil.rmtree(save)
    finally:
        training_io.save_checkpoint = real["sync"]
        AsyncSaver.save, AsyncSaver.poll, AsyncSaver.wait = real["async"], real["poll"], real["wait"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=7)
    parser.add_argument("--train-iters", type=int, default=12)
    parser.add_argument("--save-interval", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a new folder under "
                                                    "the system's temporary folder)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    from megatron.testing import run_distributed

    start_machine = machine()
    corpus = tiny_corpus()
    argv = tiny_argv(corpus, hidden_size=args.hidden_size, num_layers=args.num_layers,
                     num_attention_heads=args.hidden_size // 64, seq_length=32, micro_batch_size=1,
                     global_batch_size=1, train_iters=args.train_iters, save_interval=args.save_interval,
                     log_interval=args.train_iters)
    folder = tempfile.mkdtemp(prefix="bench_checkpoint_", dir=args.dir)
    try:
        params = args.num_layers * 12 * args.hidden_size ** 2  # approximately: the bandwidth file's size
        bandwidth = disk_bandwidth(folder, 12 * params)
        (runs,) = run_distributed(_runs, world_size=1, args=(argv, folder), timeout=1800,
                                  env={"OMP_NUM_THREADS": str(args.threads)})
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    per_save = {}
    for mode, run in runs.items():
        per_save[mode] = {kind: [round(seconds, 4) for k, seconds in run["blocked"] if k == kind]
                          for kind in (("sync",) if mode == "sync" else ("async", "poll", "wait"))}
        per_save[mode]["checkpoint_bytes"] = run["tag_bytes"]
    sync_s = statistics.median(per_save["sync"]["sync"])
    copy_s = statistics.median(per_save["async"]["async"])
    finish_s = statistics.median(per_save["async"]["poll"]) if per_save["async"]["poll"] else 0.0
    throughput = per_save["sync"]["checkpoint_bytes"] / sync_s
    emit({"benchmark": "checkpoint",
          "config": {"hidden_size": args.hidden_size, "num_layers": args.num_layers, "train_iters": args.train_iters,
                     "save_interval": args.save_interval, "threads": args.threads, "precision": "fp32",
                     "filesystem": _filesystem(folder)},
          "machine_at_start": start_machine, "blocked_s": per_save,
          "sync_median_s": round(sync_s, 4), "async_copy_median_s": round(copy_s, 4),
          "async_finish_median_s": round(finish_s, 4),
          "async_over_sync_blocked": round((copy_s + finish_s) / sync_s, 4),
          "disk_write_bytes_per_s": round(bandwidth),
          "sync_save_bytes_per_s": round(throughput),
          "sync_save_over_disk_bandwidth": round(throughput / bandwidth, 4)}, args.output)


if __name__ == "__main__":
    main()
