"""A throw-away cluster of simulated nodes on this machine, for multi-node tests (root needed).

    reason = netns_unavailable()                      # '' or why it cannot run here (pytest.skip(reason))
    with NetnsCluster(root, nodes=2) as cluster:      # root: a folder of the test's
        proc = cluster.popen(0, ["hostname"], stdout=subprocess.PIPE)   # a command on node 0 (a Popen)
        cluster.cut(1); cluster.restore(1)            # node 1's link down (no process dies, nothing is reset) / up
        cluster.shape(1, rate_mbit=100)               # tc on node 1's outgoing link (tbf rate; delay_ms: netem, where the
                                                      # kernel has it: not here); unshape(1)
        cluster.kill_node(1)                          # SIGKILL every process on node 1
        cluster.pids(1)                               # the processes living on node 1

Each node is a network namespace with one link, ``eth0``, to a bridge (itself in a namespace of its own, the
"switch": nothing is added to the machine's own network), an address in a private /24 drawn per cluster, ``lo`` up,
and for each command a UTS + mount namespace (``unshare``) giving it the node's hostname, an /etc/hosts naming every
node (so c10d's rendezvous resolves them, as on a cluster without DNS), and a private /tmp: the node's scratch folder
``cluster.scratch(i)`` (also TMPDIR). The folders of ``visible`` (by default ``cluster.shared``, the stand-in for the
cluster filesystem, and the cluster's root) are bound through into that /tmp at their own paths, so a path under
/tmp means the same on every node. Commands get ``GLOO_SOCKET_IFNAME=eth0``.

Names carry the pid and a random tag (``mn<pid>x<tag>-n0``), so parallel pytest workers and leftovers of a killed
run cannot collide. ``stop()`` (also on ``__exit__`` and when ``start`` fails) kills every process still inside a
node's namespace (``ip netns pids``), then deletes the namespaces, which removes the veths and the bridge with them.
What a run killed with -9 left behind, the next cluster's ``start`` removes (``remove_stale_namespaces``: the
names of a pid no longer running).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import time


def netns_unavailable() -> str:
    """'' when this process can build a cluster (root, `ip` and `unshare` present, namespaces allowed), else why
    not."""
    if os.geteuid() != 0:
        return "simulated nodes need root (network namespaces, a bridge, bind mounts)"
    for tool in ("ip", "unshare", "tc"):
        if not shutil.which(tool):
            return f"simulated nodes need `{tool}` (iproute2 / util-linux), which is not installed"
    name = f"mnprobe{os.getpid()}x{secrets.token_hex(2)}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode:
        return f"`ip netns add` is refused here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ""


NAME = re.compile(r"^mn(\d+)x[0-9a-f]{4}-(?:sw|n\d+)$")


def remove_stale_namespaces() -> list[str]:
    """Delete the namespaces (and kill the processes in them) that a cluster of a process no longer running left
    behind (a pytest run killed with -9 could not tear down); returns their names."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout.split("\n")
    stale = [line.split()[0] for line in listed if line.split() and NAME.match(line.split()[0])
             and not os.path.exists(f"/proc/{NAME.match(line.split()[0])[1]}")]
    for ns in stale:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    return stale


def _run(*cmd: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


class NetnsCluster:
    def __init__(self, root, nodes: int = 2, visible=()):
        self.root = os.path.abspath(root)
        self.nodes = nodes
        tag = f"mn{os.getpid()}x{secrets.token_hex(2)}"
        self.switch = f"{tag}-sw"
        self.namespaces = [f"{tag}-n{i}" for i in range(nodes)]
        # a private 10.x.y.0/24 per cluster: only ever inside the namespaces, drawn so two clusters differ
        self.subnet = f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(250) + 1}"
        self.hostnames = [f"node{i}" for i in range(nodes)]
        self.shared = os.path.join(self.root, "shared")
        self.visible = [self.root, *map(os.path.abspath, visible)]
        self.made: list[str] = []

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def scratch(self, i: int) -> str:
        """Node ``i``'s local folder: its /tmp and TMPDIR, seen by no other node."""
        return os.path.join(self.root, f"node{i}-local")

    # ----- start / stop -------------------------------------------------------------------------

    def __enter__(self) -> "NetnsCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        remove_stale_namespaces()
        os.makedirs(self.shared, exist_ok=True)
        hosts = os.path.join(self.root, "hosts")
        with open(hosts, "w") as f:
            f.write("127.0.0.1 localhost\n::1 localhost\n")
            f.writelines(f"{self.address(i)} {name}\n" for i, name in enumerate(self.hostnames))
        for ns in [self.switch, *self.namespaces]:
            _run("ip", "netns", "add", ns)
            self.made.append(ns)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            os.makedirs(self.scratch(i), exist_ok=True)
            for path in self.visible:  # mount points for the folders bound through into the node's /tmp
                if path.startswith("/tmp/"):
                    os.makedirs(os.path.join(self.scratch(i), os.path.relpath(path, "/tmp")), exist_ok=True)
            # created straight inside the two namespaces: the machine's own eth0 is never touched
            _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns",
                 self.switch)
            _run("ip", "-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def stop(self) -> None:
        for ns in self.namespaces:
            if ns in self.made:
                self.kill_node(self.namespaces.index(ns))
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made.clear()

    # ----- commands ----------------------------------------------------------------------------

    def popen(self, i: int, cmd: list[str], env: dict | None = None, **kwargs) -> subprocess.Popen:
        """``cmd`` on node ``i``: in its network namespace, with its hostname, /etc/hosts and private /tmp, and
        ``env`` (default ``os.environ``) plus TMPDIR and GLOO_SOCKET_IFNAME=eth0. ``kwargs`` go to Popen."""
        scratch = self.scratch(i)
        binds = [f"mount --bind {_q(p)} {_q(os.path.join(scratch, os.path.relpath(p, '/tmp')))}"
                 for p in self.visible if p.startswith("/tmp/")]
        setup = " && ".join([
            "mount --make-rprivate /",
            f"mount --bind {_q(os.path.join(self.root, 'hosts'))} /etc/hosts",
            f"hostname {self.hostnames[i]}",
            *binds,
            f"mount --rbind {_q(scratch)} /tmp",
            'exec "$@"',
        ])
        env = dict(os.environ if env is None else env, TMPDIR="/tmp", GLOO_SOCKET_IFNAME="eth0")
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[i], "unshare", "--uts", "--mount", "sh", "-c",
                                 setup, "sh", *cmd], env=env, **kwargs)

    def run(self, i: int, cmd: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        proc = self.popen(i, cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)
        out, _ = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, None)

    def pids(self, i: int) -> list[int]:
        """Every process living in node ``i``'s network namespace."""
        proc = subprocess.run(["ip", "netns", "pids", self.namespaces[i]], capture_output=True, text=True, timeout=30)
        return [int(p) for p in proc.stdout.split()]

    def kill_node(self, i: int, wait_s: float = 10) -> None:
        """SIGKILL every process of node ``i`` (again, until none is left: a dying launcher may still fork)."""
        deadline = time.time() + wait_s
        while True:
            pids = self.pids(i)
            if not pids or time.time() > deadline:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    # ----- the links ---------------------------------------------------------------------------

    def cut(self, i: int) -> None:
        """Node ``i``'s link down, from inside the node (a failed NIC or switch port): no process is told."""
        _run("ip", "-n", self.namespaces[i], "link", "set", "eth0", "down")

    def restore(self, i: int) -> None:
        _run("ip", "-n", self.namespaces[i], "link", "set", "eth0", "up")

    def shape(self, i: int, delay_ms: float = 0, rate_mbit: float = 0) -> None:
        """Slow node ``i``'s outgoing traffic: netem ``delay_ms`` and/or a tbf ``rate_mbit`` (replacing any
        shaping before)."""
        self.unshape(i)
        dev = ["ip", "netns", "exec", self.namespaces[i], "tc", "qdisc", "add", "dev", "eth0"]
        parent = ["root"]
        if delay_ms:
            try:
                _run(*dev, *parent, "handle", "1:", "netem", "delay", f"{delay_ms}ms")
            except RuntimeError as error:
                if "qdisc kind is unknown" in str(error):
                    raise RuntimeError("this kernel has no netem qdisc (sch_netem; the machine of 2026-12 has none): "
                                       "shape with rate_mbit (tbf) alone") from error
                raise
            parent = ["parent", "1:1"]
        if rate_mbit:
            _run(*dev, *parent, "handle", "10:", "tbf", "rate", f"{rate_mbit}mbit", "burst", "32kbit",
                 "latency", "400ms")

    def shaped_bytes(self, i: int) -> int:
        """Bytes that went out through node ``i``'s shaping (its root qdisc's "Sent N bytes")."""
        out = _run("ip", "netns", "exec", self.namespaces[i], "tc", "-s", "qdisc", "show", "dev", "eth0")
        sent = re.search(r"Sent (\d+) bytes", out)
        return int(sent[1]) if sent else 0

    def unshape(self, i: int) -> None:
        subprocess.run(["ip", "netns", "exec", self.namespaces[i], "tc", "qdisc", "del", "dev", "eth0", "root"],
                       capture_output=True, timeout=30)


def _q(path: str) -> str:
    return "'" + path.replace("'", "'\\''") + "'"
