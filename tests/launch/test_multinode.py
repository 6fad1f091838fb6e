"""pretrain_gpt.py across two simulated nodes (tests/helpers/netns_cluster.py: a network namespace each, its own
address, hostname, /etc/hosts and /tmp, one bridge between them, a shared folder for the checkpoints, the data and
TensorBoard), launched as examples/slurm/launch_lib.sh's torchrun style does: one ``torchrun --nnodes 2
--rdzv_backend c10d --rdzv_endpoint node0:PORT`` per node. TP=2 x PP=2, two ranks a node (node0 holds stage 0,
node1 stage 1: c10d's rendezvous orders the nodes by host name, so the pipeline's sends cross the link).

One job, launched three times on the same checkpoints (saved every 2 iterations), as a user relaunches after losing
a node:
1. node1's every process killed inside iteration 6 (``faults.paused_env``): node0's job ends non-zero, its output
   naming node1's address, and nothing is left on either node.
2. Relaunched with node1's link slowed to 10 Mbit/s (tc's tbf), it resumes from the newest complete checkpoint (4);
   inside iteration 10 node1's link is cut (``ip link set eth0 down`` inside it: no process dies, no connection is
   reset): with --hang-watchdog-factor a rank of node0 reports the overdue step and names ranks 2, 3 and their host
   node1 as not answering, and the job ends non-zero; the link back up, node1's processes end too.
3. Relaunched, it resumes from 8, ends 0 on both nodes, and leaves nothing running.
Every loss the three launches logged on two nodes is the one-node run's, bit for bit (the same operations in the
same order; only the transport differs): the launches together cover iterations 1 to 12.

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

ITERS = 12
# node1 is lost inside these iterations; checkpoints every 2: the relaunches resume at 4 and 8. The relaunch that is
# cut first trains 5 to 9: 2 warm-up steps the watchdog leaves out, then 3 it times (the last holds the pause), whose
# median sets its threshold
KILLED_AT, CUT_AT = 6, 10
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


def _assert_losses(got: dict[int, float], one_node, label):
    """Bit for bit: TensorBoard keeps each loss as a float32 (the loss itself is an fp32 scalar)."""
    expected = {it: np.float32(loss) for it, loss in enumerate(one_node, start=1) if it in got}
    assert {it: np.float32(v) for it, v in got.items()} == expected, label


class Launch:
    """One launch of the job (``name``: its TensorBoard folder and its pause folder), started on both nodes."""

    def __init__(self, cluster, corpus, name, pause_after=None):
        self.folder = os.path.join(cluster.shared, "job")
        self.pause = os.path.join(self.folder, f"pause-{name}")
        self.tensorboard = os.path.join(self.folder, f"tb-{name}")
        argv = tiny_argv(corpus, *LAYOUT, *WATCHDOG, train_iters=ITERS, save=f"{self.folder}/ckpt",
                         load=f"{self.folder}/ckpt", save_interval=2, tensorboard_dir=self.tensorboard,
                         tensorboard_queue_size=1)  # each scalar written at once: node1 may die
        self.job = Job(cluster, argv, env=paused_env(self.pause, pause_after) if pause_after else None)

    def losses(self) -> dict[int, float]:
        return dict(tensorboard_scalars(self.tensorboard)["lm-loss-training/lm loss"])


def _lose_node1(cluster, launch, how):
    """``launch`` paused on every rank (``pause_after``), node1 lost (``how``: kill or cut) while it waits, then
    released; returns node0's exit status."""
    job = launch.job
    try:
        deadline = time.time() + GUARD_S
        while len([f for f in os.listdir(launch.pause) if f.startswith("paused-rank")]) < 4:
            assert time.time() < deadline and all(p.poll() is None for p in job.procs), job.output(0)[-3000:]
            time.sleep(0.2)
        if how == "kill":
            cluster.kill_node(1)
        else:
            cluster.cut(1)
        open(f"{launch.pause}/go", "w").close()
        start = time.time()
        returncode = job.wait(0, GUARD_S)
        print(f"node1 {how}: node0's job ended with {returncode} {time.time() - start:.1f} s after the release")
    except BaseException:
        job.kill()
        raise
    return returncode


def _assert_resumed_at(launch, iteration):
    output = launch.job.output(0) + launch.job.output(1)
    assert f"global_step{iteration} at iteration {iteration}" in output, launch.job.output(0)[-3000:]


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
    # inside the namespace before the next cluster looks (a loaded machine once ran the cluster's clean-up first: the
    # orphan then entered the namespace after its processes were listed, and outlived it)
    _wait_inside(lambda: subprocess.run(["ip", "netns", "pids", stale], capture_output=True, text=True).stdout.split(),
                 orphan)
    with NetnsCluster(tmp_path, nodes=2) as other:  # its start removes the stale namespace
        sleeper = other.popen(1, ["sleep", "600"])
        names = other.namespaces + [other.switch]
        _wait_inside(lambda: other.pids(1), sleeper)  # `ip netns exec` enters the namespace a moment after it starts
    assert sleeper.wait(timeout=30) != 0 and orphan.wait(timeout=30) != 0
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [name for name in [*names, stale] if name in left], left


def _wait_inside(pids_inside, process) -> None:
    """Until ``pids_inside()`` lists a process: ``process`` (an ``ip netns exec`` command) has entered its namespace.
    pytest's timeout ends a hang; a command that died instead fails here."""
    while not pids_inside():
        assert process.poll() is None, process.returncode
        time.sleep(0.05)


def test_a_lost_node_ends_the_job_naming_it_and_each_relaunch_resumes_the_one_node_losses(cluster, corpus,
                                                                                           one_node_losses):
    # 1. node1 killed: node0's job fails naming node1 (gloo's "Connection closed by peer [node1's address]")
    killed = Launch(cluster, corpus, "killed", pause_after=KILLED_AT - 1)
    returncode = _lose_node1(cluster, killed, "kill")
    assert returncode != 0 and cluster.address(1) in killed.job.output(0), killed.job.output(0)[-3000:]
    assert not cluster.pids(0) and not cluster.pids(1)

    # 2. relaunched over a slowed link (node1 sends at 10 Mbit/s: the pipeline's activations and gradients cross
    # it), then node1's link cut
    cluster.shape(1, rate_mbit=10)
    try:
        cut = Launch(cluster, corpus, "cut", pause_after=CUT_AT - 1)
        returncode = _lose_node1(cluster, cut, "cut")
        # 5 iterations (5 to 9) of 4 micro-batches' gradients went through the shaper, 16 KiB each
        shaped = cluster.shaped_bytes(1)
    finally:
        cluster.restore(1)  # node1's processes are stuck on connections to node0; back up, they end
        cluster.unshape(1)
    output = cut.job.output(0)
    assert returncode != 0, output[-3000:]
    # the first of node0's ranks whose step is overdue reports (rank 0 or 1: the other dumps its stacks on request)
    reports = re.findall(r"hang watchdog: rank [01]: rank\(s\) (.*) did not answer .*; host\(s\): (.*)", output)
    assert reports and set(reports) == {("2, 3", "node1 (ranks 2, 3)")}, output[-3000:]
    assert not cluster.pids(0)
    start = time.time()
    print(f"node1's job ended with {cut.job.wait(1, GUARD_S)} {time.time() - start:.1f} s after its link was back")
    assert not cluster.pids(1)
    _assert_resumed_at(cut, KILLED_AT - 2)
    assert shaped > 3 * 4 * 16 * 1024, shaped

    # 3. relaunched: it runs to the end
    last = Launch(cluster, corpus, "last")
    try:
        returncodes = [last.job.wait(i, 300) for i in range(cluster.nodes)]
    finally:
        last.job.kill()
    assert returncodes == [0, 0], last.job.output(0)[-3000:] + last.job.output(1)[-3000:]
    assert "host      : node" not in last.job.output(0)  # no failure report
    assert not cluster.pids(0) and not cluster.pids(1)
    _assert_resumed_at(last, CUT_AT - 2)

    # each launch logged from where it resumed to where it was stopped (a killed node's last scalar may be lost
    # with it: its TensorBoard writer was on the last stage), and together every iteration
    logged = [launch.losses() for launch in (killed, cut, last)]
    spans = [range(1, KILLED_AT), range(KILLED_AT - 1, CUT_AT), range(CUT_AT - 1, ITERS + 1)]
    assert all(set(losses) <= set(span) and min(losses) == span[0] for losses, span in zip(logged, spans)), logged
    assert sorted(logged[2]) == list(spans[2]) and set().union(*logged) == set(range(1, ITERS + 1)), logged
    for launch, losses in zip(("killed", "cut", "last"), logged):
        _assert_losses(losses, one_node_losses, f"two nodes, the {launch} launch")
