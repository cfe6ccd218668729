"""One running deployment: the orchestrator and every role process, started, watched and stopped."""

from __future__ import annotations

import logging
import os
import signal
import socket
import tempfile
import time
import uuid
from pathlib import Path

import msgspec

from launcher.client import Client, Unreachable
from transport.auth import client_curve
from launcher.supervisor import Child, Supervisor
from launcher.topology import DeploymentConfig, Placement, place
from transport.messages import StatusReport
from transport.lane import lane_path
from transport.shm import SHM_PREFIX, remove_segments

log = logging.getLogger("disagg.launcher")

POLL_S = 0.2
PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)


class BootError(RuntimeError):
    """A process of the deployment failed before it was ready."""


class Deployment:
    """Starts the orchestrator and N:M:K roles, waits for them, and tears everything down."""

    def __init__(self, config: DeploymentConfig, run_dir: str | Path | None = None):
        self.config = config
        self.run_id = uuid.uuid4().hex[:8]
        self.run_dir = Path(run_dir) if run_dir else Path(tempfile.gettempdir()) / "disagg" / self.run_id
        self.supervisor = Supervisor(self.run_dir)
        self.placements: list[Placement] = place(config)
        self.endpoint = f"tcp://{config.host}:{config.port}"
        self.host_id = socket.gethostname()
        self.shm_prefix = f"{SHM_PREFIX}{self.run_id}-"
        self.interrupted = False
        self.keys_dir = str(Path(config.keys).resolve()) if config.keys else ""
        self.curve = client_curve(Path(self.keys_dir)) if self.keys_dir else None

    def client(self) -> Client:
        return Client(self.endpoint, curve=self.curve)

    # --- lifecycle --------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        def on_signal(signum, _frame):
            self.interrupted = True

        # SIGHUP too: a closed terminal must still stop everything cleanly
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, on_signal)

    def start(self) -> None:
        """Spawn everything; return once every instance is ready. Raises BootError."""
        self.start_processes()
        self.wait_ready()

    def start_processes(self) -> None:
        """Spawn the orchestrator, wait until it answers, then spawn every role."""
        c = self.config
        self.supervisor.spawn(
            "orchestrator",
            self.supervisor.python(
                "orchestrator",
                "--host", c.host, "--port", str(c.port),
                "--heartbeat-timeout", str(c.heartbeat_timeout_s),
                "--stall-timeout", str(c.stall_timeout_s),
                "--request-timeout", str(c.request_timeout_s),
                "--max-retries", str(c.max_retries), "--max-queue", str(c.max_queue),
                "--dispatch", c.dispatch, "--transfer", c.transfer, "--keys", self.keys_dir,
                *(["--colocated"] if c.colocated else []),
                *([] if c.lane else ["--no-lane"]),
            ),
            env=self._env(),
        )
        self._wait_reachable()
        for p in self.placements:
            self.spawn_role(p)

    def spawn_role(self, p: Placement) -> Child:
        spec = {
            "role": p.role,
            "instance_id": p.instance_id,
            "endpoint": f"tcp://{self.config.host}:{self.config.port + 1}",
            "model": self.config.model,
            "device": p.device,
            "capacity": p.capacity,
            "max_batch": p.max_batch,
            "dtype": self.config.dtype,
            "sim_slowdown": self.config.sim_slowdown.get(p.instance_id, 1.0),
            "pool_bytes": p.pool_bytes,
            "pool_name": f"{self.shm_prefix}{p.instance_id}",
            "host_id": self.host_id,
            "threads": p.threads,
            "transfer": self.config.transfer,
            "transfer_protocol": self.config.protocol,
            "ib_device": self.config.ib_device,
            "data_host": self.config.host,
            "visible_gpus": self.visible_gpus(p),
            "orchestrator_timeout_s": self.config.heartbeat_timeout_s,
            "keys_dir": self.keys_dir,
            "use_lane": self.config.lane,
        }
        env = self._env()
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, spec["visible_gpus"]))
        env["OMP_NUM_THREADS"] = str(p.threads)
        return self.supervisor.spawn(
            p.instance_id, self.supervisor.python("roles", msgspec.json.encode(spec).decode()), env=env, cpus=p.cpus
        )

    def visible_gpus(self, p: Placement) -> list[int]:
        """The role's own GPU first (its cuda:0), then the host's other GPUs, for CUDA IPC to peers."""
        if p.gpu is None or p.simulated:
            return []
        return [p.gpu] + [g for g in self.config.all_gpus() if g != p.gpu]

    def _env(self) -> dict[str, str]:
        path = os.environ.get("PYTHONPATH")
        return {
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": PROJECT_ROOT + (os.pathsep + path if path else ""),
            "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
            "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR"),
            "DISAGG_RUN_ID": self.run_id,
        }

    def supervise(self) -> None:
        """From now on dead children are restarted (before, any death stops the launch)."""
        self.supervisor.start_supervising()

    def _check_children(self) -> None:
        for child in self.supervisor.reap_children():
            why = "failed to start" if child.boot_error else f"exited with status {child.returncode}"
            raise BootError(f"{child.name} {why} before the deployment was ready; last log lines "
                            f"({child.log_path}):\n{child.log_tail()}")

    def _wait_reachable(self) -> None:
        deadline = time.monotonic() + 30
        with self.client() as client:
            while True:
                self._check_children()
                if self.interrupted:
                    raise KeyboardInterrupt
                try:
                    client.status(timeout_s=0.5)
                    return
                except Unreachable:
                    if time.monotonic() > deadline:
                        raise BootError(f"the orchestrator did not answer at {self.endpoint} within 30 s") from None

    def wait_ready(self, on_status=None) -> StatusReport:
        expected = {p.instance_id for p in self.placements}
        deadline = time.monotonic() + self.config.ready_timeout_s
        with self.client() as client:
            while True:
                self._check_children()
                if self.interrupted:
                    raise KeyboardInterrupt
                report = client.status(timeout_s=5)
                if on_status:
                    on_status(report)
                ready = {i.id for i in report.instances if i.state == "ready"}
                if expected <= ready:
                    return report
                if time.monotonic() > deadline:
                    missing = ", ".join(sorted(expected - ready))
                    raise BootError(f"not ready after {self.config.ready_timeout_s:g} s: {missing}")
                time.sleep(POLL_S)

    def status(self, client: Client) -> StatusReport | None:
        try:
            return client.status(timeout_s=2)
        except Unreachable:
            return None

    def shutdown(self) -> None:
        """Ask the orchestrator to stop the roles, then make sure every process and segment is gone."""
        self.supervisor.stop_supervising()
        if self.supervisor.children.get("orchestrator") and self.supervisor.running():
            try:
                with self.client() as client:
                    client.stop(timeout_s=1)
                deadline = time.monotonic() + 3
                while self.supervisor.running() and time.monotonic() < deadline:
                    time.sleep(0.05)
            except (Unreachable, RuntimeError):
                pass
        self.supervisor.stop_all()
        try:  # a killed orchestrator leaves its lane's socket file behind
            os.unlink(lane_path(self.config.port))
        except FileNotFoundError:
            pass
        leftover = remove_segments(self.shm_prefix)
        if leftover:
            log.info("removed %d shared-memory segments left by killed processes", len(leftover))
