"""A real Slurm cluster for tests: Debian's `munged`, `slurmctld` in the root namespace and one `slurmd` per
network-namespace node (tests/netns.py), each node declaring GPUs as generic resources backed by placeholder
character devices, so that Slurm sets CUDA_VISIBLE_DEVICES per job step as it does on a GPU cluster.

Everything lives in one temporary folder: the config (slurm.conf, gres.conf), munge's key and socket (Slurm
reaches munge through `AuthInfo=socket=`), the controller's state, each node's spool and logs. Its ports are free
ones found at start. Processes are known by their pids only, and `close()` stops every one and removes the
namespaces, also after a failure. Needs root and `slurm-wlm` + `munge` (`.ci/run` installs them)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from disagg.launcher.ports import free_port_pair
from tests.netns import Hosts

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "squeue", "sinfo", "scontrol")
#: the cgroup v1 hierarchies slurmd looks for at start, mounted inside each node's own mount namespace
CGROUPS = ("cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids")


def available() -> str:
    """'' when a Slurm cluster can be started here, else why not."""
    if os.geteuid() != 0:
        return "a Slurm cluster of namespace nodes needs root"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    return f"not installed: {', '.join(missing)} (apt-get install slurm-wlm munge)" if missing else ""


def _wait(pred, timeout: float, why) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise RuntimeError(f"slurm test cluster: {why()}")


class SlurmCluster:
    """`nodes` namespace nodes with `gpus` placeholder GPUs each, under a real controller."""

    def __init__(self, folder: Path, nodes: int, gpus: int, cpus: int = 2):
        self.folder = folder
        self.gpus = gpus
        self.procs: list[subprocess.Popen] = []
        self.hosts: Hosts | None = None
        folder.mkdir(parents=True, exist_ok=True)
        try:
            self.hosts = Hosts(nodes)
            self._start(cpus)
        except BaseException:
            self.close()
            raise

    @property
    def names(self) -> list[str]:
        return self.hosts.names

    @property
    def env(self) -> dict[str, str]:
        """What a Slurm command of this cluster needs: its config."""
        return {**os.environ, "SLURM_CONF": str(self.folder / "slurm.conf")}

    def run(self, *argv: str, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        """A Slurm client command (sbatch, squeue, scancel, ...) against this cluster."""
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              env={**self.env, **kw.pop("env", {})}, **kw)

    def _spawn(self, argv: list[str], log: str, host: int | None = None) -> subprocess.Popen:
        if host is not None:
            return self.hosts.popen(host, argv, self.folder / log)
        proc = subprocess.Popen(argv, stdout=open(self.folder / log, "w"), stderr=subprocess.STDOUT,
                                start_new_session=True, env=self.env)
        self.procs.append(proc)
        return proc

    def _start(self, cpus: int) -> None:
        f = self.folder
        for d in ("state", "munge", "dev"):
            (f / d).mkdir(mode=0o700, exist_ok=True)
        key = f / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = f / "munge" / "munge.socket"
        self._spawn(["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={sock}",
                     f"--pid-file={f / 'munge' / 'munged.pid'}", f"--log-file={f / 'munge' / 'munged.log'}",
                     f"--seed-file={f / 'munge' / 'munged.seed'}"], "munged.out")
        _wait(sock.exists, 30, lambda: f"munged did not start: {(f / 'munged.out').read_text()[-500:]}")
        for g in range(self.gpus):  # the GPUs' placeholder device files: character devices, as Slurm requires
            dev = f / "dev" / f"nvidia{g}"
            if not dev.exists():
                os.mknod(dev, 0o600 | 0o020000, os.makedev(1, 3))
        ctl_port, node_port = free_port_pair(), free_port_pair()
        bridge = f"10.{self.hosts.subnet}.0.254"
        nodes = "\n".join(
            f"NodeName={name} NodeAddr={self.hosts.addr(i)} CPUs={cpus} RealMemory=4096 Gres=gpu:{self.gpus} "
            "State=UNKNOWN" for i, name in enumerate(self.names))
        (f / "slurm.conf").write_text(f"""\
ClusterName=dg{self.hosts.tag}
SlurmctldHost={socket.gethostname()}({bridge})
SlurmctldPort={ctl_port}
SlurmdPort={node_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
StateSaveLocation={f / 'state'}
SlurmdSpoolDir={f}/spool-%n
SlurmctldPidFile={f / 'slurmctld.pid'}
SlurmdPidFile={f}/slurmd-%n.pid
SlurmctldLogFile={f / 'slurmctld.log'}
SlurmdLogFile={f}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
MpiDefault=none
SwitchType=switch/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=20
KillWait=30
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        (f / "gres.conf").write_text(f"Name=gpu File={f / 'dev'}/nvidia[0-{self.gpus - 1}]\n" if self.gpus else "")
        self._spawn(["slurmctld", "-D", "-i", "-f", str(f / "slurm.conf")], "slurmctld.out")
        mounts = " && ".join([f"mkdir -p /sys/fs/cgroup/{c} && mount -t cgroup -o {c} cgroup /sys/fs/cgroup/{c}"
                              for c in CGROUPS] + ["mkdir -p /sys/fs/cgroup/systemd && mount -t cgroup -o "
                                                   "none,name=systemd cgroup /sys/fs/cgroup/systemd"])
        for i, name in enumerate(self.names):
            (f / f"spool-{name}").mkdir(exist_ok=True)
            script = (f"mount -t tmpfs cgroup_root /sys/fs/cgroup && {mounts} && "
                      f"exec slurmd -D -N {name} -f {f / 'slurm.conf'}")
            self._spawn(["env", f"SLURM_CONF={f / 'slurm.conf'}", "sh", "-c", script], f"slurmd-{name}.out", host=i)
        _wait(self._idle, 60, lambda: f"nodes not idle: {self.run('sinfo', '-N', '-h').stdout!r}; "
                                      f"{(f / 'slurmctld.log').read_text()[-800:] if (f / 'slurmctld.log').exists() else ''}")

    def _idle(self) -> bool:
        res = self.run("sinfo", "-N", "-h", "-o", "%N %T")
        states = dict(line.split() for line in res.stdout.splitlines() if line.strip())
        return res.returncode == 0 and len(states) == len(self.names) and all(s == "idle" for s in states.values())

    def sbatch(self, *args: str, env: dict | None = None, cwd: Path | None = None) -> str:
        """Submit (from `cwd`: the job's SLURM_SUBMIT_DIR); the job id."""
        res = self.run("sbatch", "--parsable", *args, env=env or {}, cwd=cwd)
        if res.returncode:
            raise RuntimeError(f"sbatch {' '.join(args)}: {res.stderr.strip()}")
        return res.stdout.strip().split(";")[0]

    def job_state(self, job: str) -> str:
        res = self.run("scontrol", "show", "job", job)
        for word in res.stdout.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return ""

    def node_pids(self, i: int, job: str = "") -> list[int]:
        """Every process in node i's network namespace but its slurmd; with `job`, only that job's (its steps'
        slurmstepd, and whatever has its SLURM_JOB_ID in its environment)."""
        res = subprocess.run(["ip", "netns", "pids", self.names[i]], capture_output=True, text=True)
        pids = []
        for pid in map(int, res.stdout.split()):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                if comm == "slurmd":
                    continue
                if job:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    if not (cmdline.startswith(f"slurmstepd: [{job}.".encode())
                            or f"SLURM_JOB_ID={job}".encode() in environ):
                        continue
            except OSError:
                continue
            pids.append(pid)
        return pids

    def node_shm(self, i: int) -> list[str]:
        """The shared-memory segments on node i (its private /dev/shm, seen through its slurmd's mount namespace)."""
        res = subprocess.run(["nsenter", "-t", str(self.hosts.procs[i].pid), "-m", "ls", "-A", "/dev/shm"],
                             capture_output=True, text=True)
        return res.stdout.split()

    def close(self) -> None:
        """Stop every job, every daemon (by pid), and remove the nodes' namespaces."""
        if self.hosts is not None and (self.folder / "slurm.conf").exists():
            try:
                self.run("scancel", "--full", "--user=root", timeout=10)
            except (subprocess.SubprocessError, OSError):
                pass
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        if self.hosts is not None:
            self.hosts.close()  # the slurmds and anything left in the namespaces
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
