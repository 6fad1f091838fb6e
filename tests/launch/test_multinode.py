"""pretrain_gpt.py across two simulated nodes (tests/helpers/netns_cluster.py: a network namespace each, its own
address, hostname, /etc/hosts and /tmp, one bridge between them, a shared folder for the checkpoints, the data and
TensorBoard), launched as examples/slurm/launch_lib.sh's torchrun style does: one ``torchrun --nnodes 2
--rdzv_backend c10d --rdzv_endpoint node0:PORT`` per node. TP=2 x PP=2, two ranks a node (node0 holds stage 0,
node1 stage 1: c10d's rendezvous orders the nodes by host name, so the pipeline's sends cross the link).

- Two nodes train the one-node run's fp32 losses bit for bit (the same operations in the same order; only the
  transport differs).
- Every process of node1 killed mid-run (inside iteration 6, ``faults.paused_env``): node0's job ends non-zero, its
  output naming node1's address, and nothing is left on either node; relaunched (node1's link slowed to 10 Mbit/s
  by tc's tbf), the job resumes from the newest complete checkpoint (4) and ends with the uninterrupted run's
  losses.
- node1's link cut (``ip link set eth0 down`` inside it: no process dies, no connection is reset): with
  --hang-watchdog-factor a rank of node0 reports the overdue step and names ranks 2, 3 and their host node1 as not
  answering, and the job ends non-zero; the link back up, node1's processes end too; relaunched, it resumes exactly.

Skipped (with the reason) where namespaces cannot be made: not root, no iproute2.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

from megatron.testing import run_distributed, tiny_argv
from megatron.testing.tiny_corpus import make_tiny_corpus
from tests.helpers.faults import paused_env
from tests.helpers.netns_cluster import NetnsCluster, netns_unavailable
from tests.helpers.paths import REPO_ROOT
from tests.helpers.training import tensorboard_scalars, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ITERS = 8
LOST_AT = 6  # node1 is lost inside this iteration; checkpoints every 2: the newest complete one is 4
RDZV_PORT = 29400  # inside the cluster's namespaces: no other process can hold it
LAYOUT = ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
# --hang-watchdog-*: a step of this job takes well under a second; 10 s is far above it and far under the
# collective timeout (1 minute), which alone ends a cut-off job too, but names nobody (see docs/slurm.md)
WATCHDOG = ("--hang-watchdog-factor", "5", "--hang-watchdog-min-seconds", "10", "--hang-watchdog-warmup-iters", "2",
            "--distributed-timeout-minutes", "1")
GUARD_S = 180  # the bound for a lost node to end the job; a hang guard, not a timing


@pytest.fixture(scope="module")
def cluster():
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    root = tempfile.mkdtemp(prefix="multinode-", dir="/tmp")
    try:
        with NetnsCluster(root, nodes=2) as cluster:
            yield cluster
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def corpus(cluster):
    return make_tiny_corpus(os.path.join(cluster.shared, "corpus"))


@pytest.fixture(scope="module")
def one_node_losses(corpus):
    """The same layout's losses on one host (4 ranks of one process group, no launcher)."""
    ranks = run_distributed(train, world_size=4, args=([tiny_argv(corpus, *LAYOUT, train_iters=ITERS)],), timeout=300)
    record = ranks[0][0]
    assert record["iterations"] == list(range(1, ITERS + 1))
    return record["losses"]


class Job:
    """One torchrun per node, as launch_lib.sh's torchrun style starts them; each node's output kept by a thread."""

    def __init__(self, cluster, argv, env=None):
        env = {k: v for k, v in (env or os.environ).items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        self.procs, self.lines, self.readers = [], [], []
        for i in range(cluster.nodes):
            cmd = [sys.executable, "-u", "-m", "torch.distributed.run", "--signals-to-handle", "SIGINT,SIGHUP,SIGQUIT",
                   "--nproc_per_node", "2", "--nnodes", str(cluster.nodes), "--rdzv_backend", "c10d",
                   "--rdzv_endpoint", f"{cluster.hostnames[0]}:{RDZV_PORT}", "--max_restarts", "0",
                   "--node_rank", str(i), str(REPO_ROOT / "pretrain_gpt.py"), *argv]
            proc = cluster.popen(i, cmd, env=env, cwd=cluster.shared, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
            lines: list[str] = []
            reader = threading.Thread(target=lambda p=proc, out=lines: out.extend(p.stdout), daemon=True)
            reader.start()
            self.procs.append(proc)
            self.lines.append(lines)
            self.readers.append(reader)

    def output(self, i: int) -> str:
        return "".join(self.lines[i])

    def wait(self, i: int, timeout: float) -> int:
        """Node ``i``'s exit status; an assertion with its output when it is still running after ``timeout``."""
        try:
            returncode = self.procs[i].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node{i}'s job still running {timeout:.0f} s on:\n{self.output(i)[-4000:]}")
        self.readers[i].join(timeout=10)
        return returncode

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def _argv(corpus, cluster, name, tensorboard, *extra):
    """The job's flags: checkpoints every 2 iterations in the shared folder (--load = --save, so a relaunch
    resumes), TensorBoard in ``name/tensorboard``, a folder per launch (each scalar written at once: node1 may
    die)."""
    folder = os.path.join(cluster.shared, name)
    return tiny_argv(corpus, *LAYOUT, *extra, train_iters=ITERS, save=f"{folder}/ckpt", load=f"{folder}/ckpt",
                     save_interval=2, tensorboard_dir=f"{folder}/{tensorboard}", tensorboard_queue_size=1)


def _losses(tensorboard_dir) -> dict[int, float]:
    return dict(tensorboard_scalars(tensorboard_dir)["lm-loss-training/lm loss"])


def _assert_losses(got: dict[int, float], one_node, label):
    """Bit for bit: TensorBoard keeps each loss as a float32 (the loss itself is an fp32 scalar)."""
    expected = {it: np.float32(loss) for it, loss in enumerate(one_node, start=1) if it in got}
    assert {it: np.float32(v) for it, v in got.items()} == expected, label


def _lose_node1(cluster, corpus, name, how, extra=()):
    """A job paused after iteration LOST_AT - 1 on every rank; node1 lost (``how``: kill or cut) while it waits;
    then released. Returns the job, node0's exit status, and the losses it logged."""
    folder = os.path.join(cluster.shared, name)
    argv = _argv(corpus, cluster, name, "tb-lost", *extra)
    job = Job(cluster, argv, env=paused_env(f"{folder}/pause", LOST_AT - 1))
    try:
        deadline = time.time() + GUARD_S
        while len([f for f in os.listdir(f"{folder}/pause") if f.startswith("paused-rank")]) < 4:
            assert time.time() < deadline and all(p.poll() is None for p in job.procs), job.output(0)[-3000:]
            time.sleep(0.2)
        if how == "kill":
            cluster.kill_node(1)
        else:
            cluster.cut(1)
        open(f"{folder}/pause/go", "w").close()
        start = time.time()
        returncode = job.wait(0, GUARD_S)
        print(f"node1 {how}: node0's job ended with {returncode} {time.time() - start:.1f} s after the release")
    except BaseException:
        job.kill()
        raise
    return job, returncode, _losses(f"{folder}/tb-lost")


def _relaunch(cluster, corpus, name, one_node, lost_losses, extra=(), rate_mbit=0):
    """The same job relaunched on both nodes (node1's link shaped to ``rate_mbit`` by tbf where given): it resumes
    from the newest complete checkpoint and, with the losses the lost launch logged before, ends with the one-node
    run's losses."""
    folder = os.path.join(cluster.shared, name)
    argv = _argv(corpus, cluster, name, "tb-relaunch", *extra)
    if rate_mbit:
        cluster.shape(1, rate_mbit=rate_mbit)
    try:
        job = Job(cluster, argv)
        try:
            returncodes = [job.wait(i, 300) for i in range(cluster.nodes)]
        finally:
            job.kill()
        # the pipeline's traffic went through the shaper: 4 iterations of 4 micro-batches' gradients, 16 KiB each
        assert not rate_mbit or cluster.shaped_bytes(1) > 4 * 4 * 16 * 1024, cluster.shaped_bytes(1)
    finally:
        cluster.unshape(1)
    assert returncodes == [0, 0], job.output(1)[-3000:]
    assert f"global_step{LOST_AT - 2} at iteration {LOST_AT - 2}" in job.output(0) + job.output(1), job.output(0)
    resumed = _losses(f"{folder}/tb-relaunch")
    assert sorted(resumed) == list(range(LOST_AT - 1, ITERS + 1)), sorted(resumed)
    _assert_losses(resumed, one_node, f"{name}: the relaunch")
    _assert_losses(lost_losses, one_node, f"{name}: the lost launch")
    assert set(lost_losses) | set(resumed) == set(range(1, ITERS + 1))


def test_the_simulated_nodes_are_separate_hosts_and_leave_nothing_behind(cluster, tmp_path):
    """Each node: its hostname, every node's name resolving to its address, its own /tmp, the shared folder at the
    same path; a TCP connection from node0 to node1 by name; tc's tbf on node1's link; a cut link refuses the
    connection's packets. A second cluster, torn down with a process still running in a node, leaves no namespace
    and no process, and its start removed what a killed run had left."""
    probe = ("import os, socket, sys; open(f'/tmp/i-am-{socket.gethostname()}', 'w').close(); "
             "print(socket.gethostname(), [socket.gethostbyname(n) for n in sys.argv[1:]], os.environ['TMPDIR'], "
             "sorted(n for n in os.listdir('/tmp') if n.startswith('i-am')), os.path.isdir(os.environ['SHARED']))")
    env = dict(os.environ, SHARED=cluster.shared)
    addresses = [cluster.address(j) for j in range(cluster.nodes)]
    for i in range(cluster.nodes):
        out = cluster.run(i, [sys.executable, "-c", probe, *cluster.hostnames], env=env).stdout.strip()
        assert out == f"node{i} {addresses} /tmp ['i-am-node{i}'] True", out  # not the other node's file
        assert os.path.exists(os.path.join(cluster.scratch(i), f"i-am-node{i}"))
    listener = cluster.popen(1, [sys.executable, "-c", "import socket; s = socket.create_server(('', 5000)); "
                                 "c, _ = s.accept(); print(c.recv(5).decode())"], stdout=subprocess.PIPE, text=True)
    connect = [sys.executable, "-c", "import socket, time\nfor _ in range(100):\n    try:\n"
               "        socket.create_connection(('node1', 5000), timeout=5).send(b'hello'); break\n"
               "    except ConnectionRefusedError: time.sleep(0.1)"]
    assert cluster.run(0, connect).returncode == 0
    assert listener.communicate(timeout=30)[0].strip() == "hello"
    cluster.shape(1, rate_mbit=100)  # tbf (this machine's kernel has no netem for delay_ms)
    qdiscs = subprocess.run(["ip", "netns", "exec", cluster.namespaces[1], "tc", "qdisc", "show", "dev", "eth0"],
                            capture_output=True, text=True).stdout
    cluster.unshape(1)
    assert "tbf" in qdiscs and "rate 100Mbit" in qdiscs, qdiscs
    cluster.cut(1)
    try:
        unreachable = cluster.run(0, [sys.executable, "-c", "import socket; socket.create_connection(('node1', 5000), "
                                      "timeout=2)"])
    finally:
        cluster.restore(1)
    assert unreachable.returncode != 0, unreachable.stdout  # no route, or no answer: never "refused"
    assert any(why in unreachable.stdout for why in ("timed out", "unreachable", "No route")), unreachable.stdout
    # what a pytest killed with -9 leaves: a namespace named for a pid that no longer runs, a process inside
    with open("/proc/sys/kernel/pid_max") as f:
        stale = f"mn{int(f.read())}x0000-n0"  # pid_max itself is never a pid
    subprocess.run(["ip", "netns", "add", stale], check=True)
    orphan = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "600"])
    with NetnsCluster(tmp_path, nodes=2) as other:  # its start removes the stale namespace
        sleeper = other.popen(1, ["sleep", "600"])
        names = other.namespaces + [other.switch]
        assert other.pids(1)
    assert sleeper.wait(timeout=30) != 0 and orphan.wait(timeout=30) != 0
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [name for name in [*names, stale] if name in left], left


def test_two_nodes_train_the_one_node_losses(cluster, corpus, one_node_losses):
    folder = os.path.join(cluster.shared, "straight")
    job = Job(cluster, _argv(corpus, cluster, "straight", "tb"))
    try:
        returncodes = [job.wait(i, 300) for i in range(cluster.nodes)]
    finally:
        job.kill()
    assert returncodes == [0, 0], job.output(0)[-3000:] + job.output(1)[-3000:]
    assert "host      : node" not in job.output(0)  # no failure report
    losses = _losses(f"{folder}/tb")
    assert sorted(losses) == list(range(1, ITERS + 1))
    _assert_losses(losses, one_node_losses, "two nodes")
    assert not cluster.pids(0) and not cluster.pids(1)


def test_a_killed_node_ends_the_job_naming_it_and_a_relaunch_resumes_exactly(cluster, corpus, one_node_losses):
    job, returncode, lost = _lose_node1(cluster, corpus, "killed", "kill")
    output = job.output(0)
    assert returncode != 0, output[-3000:]
    assert cluster.address(1) in output, output[-3000:]  # gloo's "Connection closed by peer [node1's address]"
    assert not cluster.pids(0) and not cluster.pids(1)
    # relaunched over a slowed link: node1 sends at 10 Mbit/s (the pipeline's activations and gradients cross it)
    _relaunch(cluster, corpus, "killed", one_node_losses, lost, rate_mbit=10)


def test_a_cut_link_ends_the_job_naming_the_lost_node_and_a_relaunch_resumes_exactly(cluster, corpus,
                                                                                       one_node_losses):
    job, returncode, lost = _lose_node1(cluster, corpus, "cut", "cut", WATCHDOG)
    output = job.output(0)
    try:
        assert returncode != 0, output[-3000:]
        # the first of node0's ranks whose step is overdue reports (rank 0 or 1: the other dumps its stacks on request)
        reports = re.findall(r"hang watchdog: rank [01]: rank\(s\) (.*) did not answer .*; host\(s\): (.*)", output)
        assert reports and set(reports) == {("2, 3", "node1 (ranks 2, 3)")}, output[-3000:]
        assert not cluster.pids(0)
    finally:
        cluster.restore(1)  # node1's processes are stuck on connections to node0; back up, they end
    start = time.time()
    print(f"node1's job ended with {job.wait(1, GUARD_S)} {time.time() - start:.1f} s after its link was back")
    assert not cluster.pids(1)
    _relaunch(cluster, corpus, "cut", one_node_losses, lost, WATCHDOG)
