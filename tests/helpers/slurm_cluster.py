"""A throw-away single-node SLURM cluster on loopback, for tests: munged, slurmctld and slurmd started
directly (no systemd) with a private configuration in a temporary directory.

    with SlurmCluster(tmp_dir) as cluster:
        job_id = cluster.sbatch(["--ntasks=2", "script.sh"], env=...)
        state = cluster.wait(job_id, timeout_s=180)      # {"JobState": "COMPLETED", "ExitCode": "0:0", ...}

Every daemon is a child of this process, stopped by pid in ``stop()`` (also on ``__exit__``). The node
has ``cpus`` CPUs whatever the machine has (``SlurmdParameters=config_overrides``), so several tasks fit
on a 2-core machine. ``ensure_slurm_installed`` installs Debian's slurm-wlm and munge when absent.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import subprocess
import time

PACKAGES = ("slurm-wlm", "munge")
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE"}


def ensure_slurm_installed() -> str:
    """'' when sbatch, slurmctld, slurmd and munged are available (installing them with apt-get if
    needed and possible), else the reason they are not."""
    needed = ("sbatch", "squeue", "scontrol", "slurmctld", "slurmd", "munged")
    if all(shutil.which(n) for n in needed):
        return ""
    if os.geteuid() != 0:
        return "SLURM is not installed and installing it needs root (apt-get install slurm-wlm munge)"
    if not shutil.which("apt-get"):
        return "SLURM is not installed and this machine has no apt-get to install Debian's slurm-wlm"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode:
            return f"installing SLURM failed ({' '.join(cmd)} exit {proc.returncode}): {proc.stderr[-500:]}"
    missing = [n for n in needed if not shutil.which(n)]
    return f"after apt-get install, still missing: {missing}" if missing else ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    def __init__(self, root: str, cpus: int = 8):
        self.root = os.path.abspath(root)
        self.cpus = cpus
        self.node = socket.gethostname()
        self.conf = os.path.join(self.root, "slurm.conf")
        self.munge_socket = os.path.join(self.root, "munge", "munge.socket.2")
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ, SLURM_CONF=self.conf)

    # ----- start / stop -------------------------------------------------------------------------

    def __enter__(self) -> "SlurmCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout_s: float = 60) -> None:
        for sub in ("munge", "state", "spool", "log"):
            os.makedirs(os.path.join(self.root, sub), mode=0o700, exist_ok=True)
        self._start_munge()
        self._write_conf()
        log = os.path.join(self.root, "log")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf, "-L", f"{log}/slurmctld.log"])
        self._spawn("slurmd", ["slurmd", "-D", "-f", self.conf, "-N", self.node, "-L", f"{log}/slurmd.log"])
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}\n{self.logs()}")
            out = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout.strip()
            if out in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the SLURM node did not become idle within {timeout_s} s\n{self.logs()}")

    def stop(self) -> None:
        if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            try:  # jobs still running would leave slurmstepd processes behind the daemons
                self.run(["scancel", "--full", "--signal=KILL", "--state=RUNNING", "--user", str(os.getuid())],
                         check=False, timeout=15)
                self.run(["scancel", "--user", str(os.getuid())], check=False, timeout=15)
                deadline = time.time() + 20
                while time.time() < deadline and self.run(["squeue", "-h"], check=False, timeout=15).stdout.strip():
                    time.sleep(0.5)
            except subprocess.TimeoutExpired:
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(os.path.join(self.root, "log", f"{name}.stdout"), "w")
        self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
        out.close()

    def _start_munge(self) -> None:
        key = os.path.join(self.root, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(128))
        os.chmod(key, 0o400)
        m = os.path.join(self.root, "munge")
        self._spawn("munged", ["munged", "-F", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                               f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log",
                               f"--seed-file={m}/munged.seed"])
        deadline = time.time() + 20
        while not os.path.exists(self.munge_socket):
            if self.procs["munged"].poll() is not None or time.time() > deadline:
                raise RuntimeError(f"munged did not start\n{self.logs()}")
            time.sleep(0.1)

    def _write_conf(self) -> None:
        r = self.root
        user = pwd.getpwuid(os.getuid()).pw_name
        lines = [
            "ClusterName=testcluster",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "SrunPortRange=60001-63000",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: also how long a requeued job waits before it may start again (default 120 s)
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            # every port on 127.0.0.1: nothing listens on the machine's other interfaces
            "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny",
            # no cgroups and no systemd: track processes by their parent links, bind nothing
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=2",  # pending jobs (a requeued one) looked at every 2 s, not 60
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd.pid",
            "ReturnToService=2",
            "MinJobAge=600",      # finished jobs stay visible to `scontrol show job` for 10 minutes
            "KillWait=30",        # seconds between SIGTERM and SIGKILL at a time limit or scancel
            "InactiveLimit=0",
            "SlurmdTimeout=120",
            # the node claims `cpus` CPUs whatever the machine has, so several tasks fit on 2 cores
            "SlurmdParameters=config_overrides",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        ]
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    # ----- commands ----------------------------------------------------------------------------

    def run(self, cmd: list[str], check: bool = True, env: dict | None = None, timeout: float = 60):
        proc = subprocess.run(cmd, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr}\n{self.logs()}")
        return proc

    def sbatch(self, args: list[str], env: dict | None = None, cwd: str | None = None) -> int:
        proc = subprocess.run(["sbatch", "--parsable", *args], env={**self.env, **(env or {})}, cwd=cwd,
                              capture_output=True, text=True, timeout=60)
        if proc.returncode:
            raise RuntimeError(f"sbatch {' '.join(args)} exited {proc.returncode}: {proc.stderr}\n{self.logs()}")
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict:
        """``scontrol show job`` as a dict (JobState, ExitCode, StdOut, ...); {} when unknown."""
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: int, timeout_s: float, until=None) -> dict:
        """Poll until the job is in a terminal state (or ``until(info)`` is true); return its info."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            info = self.job(job_id)
            if until is not None and until(info):
                return info
            if info.get("JobState") in TERMINAL_STATES:
                return info
            time.sleep(1)
        raise TimeoutError(f"job {job_id} not finished after {timeout_s} s: {self.job(job_id)}\n{self.logs()}")

    def logs(self, tail: int = 3000) -> str:
        out = []
        log = os.path.join(self.root, "log")
        for name in ("slurmctld.log", "slurmd.log", "slurmctld.stdout", "slurmd.stdout"):
            path = os.path.join(log, name)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    out.append(f"----- {name} (tail) -----\n{f.read()[-tail:]}")
        munge_log = os.path.join(self.root, "munge", "munged.log")
        if os.path.exists(munge_log):
            with open(munge_log, errors="replace") as f:
                out.append(f"----- munged.log (tail) -----\n{f.read()[-1000:]}")
        return "\n".join(out)
