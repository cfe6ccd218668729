"""One running deployment: the orchestrator and every role process, started, watched and stopped."""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import time
import uuid
from pathlib import Path

import msgspec

from disagg.client import Client, Unreachable
from disagg.launcher.hosts import host_id, route_address
from disagg.launcher.leftovers import RunRecord, remove_leftovers
from disagg.launcher.readiness import BootError, Startup, StoppedDuringStartup  # noqa: F401 - importers take them from here
from disagg.launcher.runs import prune_runs
from disagg.launcher.supervisor import Child, Supervisor
from disagg.launcher.topology import Placement, cuda_env, place, rerole
from disagg.roles.pipelines import model_identity
from disagg.settings import Settings
from disagg.settings.devices import parse_devices
from disagg.settings.process import GatewaySettings, OrchestratorSettings, encode, schema_part
from disagg.settings.process import RoleSettings as WorkerSpec
from disagg.transport.data.shm import SHM_PREFIX, remove_segments
from disagg.transport.environment import (
    CUDA_VISIBLE_DEVICES,
    DISAGG_HTTP_API_KEY,
    DISAGG_HTTP_API_KEYS,
    DISAGG_RUN_ID,
    HF_HUB_OFFLINE,
    MC_LOG_LEVEL,
    OMP_NUM_THREADS,
    PYTHONPATH,
    PYTHONUNBUFFERED,
)
from disagg.transport.wire.auth import client_curve
from disagg.transport.wire.lane import lane_in_use, lane_path
from disagg.transport.wire.messages import IdleDevice, ModelIdentity, StatusReport

log = logging.getLogger("disagg.launcher")

#: the folder that holds the `disagg` package: on the children's PYTHONPATH, so a checkout runs without an install
PROJECT_ROOT = str(Path(__file__).resolve().parents[2])


def gateway_settings(config, endpoint: str, keys: str) -> tuple[GatewaySettings, dict[str, str]]:
    """A gateway's settings, from the deployment's: every field the schema says the gateway reads (`use`), with its
    API keys apart, as the environment variables they travel in (argv is where `ps` shows them)."""
    fields = schema_part(config, "gateway")
    fields["http"] = msgspec.structs.replace(config.http, api_key="", api_keys={})
    fields["keys"] = keys
    secrets = {DISAGG_HTTP_API_KEY: config.http.api_key,
               DISAGG_HTTP_API_KEYS: msgspec.json.encode(config.http.api_keys).decode()}
    return GatewaySettings(**fields, endpoint=endpoint), secrets


class Deployment(Startup):
    """Starts the orchestrator and N:M:K roles, waits for them, and tears everything down."""

    def __init__(self, config: Settings, run_dir: str | Path | None = None):
        self.config = config
        self.run_id = uuid.uuid4().hex[:8]
        self.run_dir = Path(run_dir) if run_dir else Path(tempfile.gettempdir()) / "disagg" / self.run_id
        if not run_dir:
            prune_runs(self.run_dir.parent)
        self.supervisor = Supervisor(self.run_dir)
        self.placements: list[Placement] = place(config)
        self.endpoint = f"tcp://{config.host}:{config.port}"
        #: where roles register (the orchestrator's port + 1), and the deployment they belong to
        self.role_endpoint = f"tcp://{config.host}:{config.port + 1}"
        self.deployment_id = self.run_id
        self.host_id = host_id()
        #: the address peers on other hosts reach this host's pools at (Mooncake's local_hostname)
        self.data_host = config.advertise_host or (
            config.host if config.host not in ("0.0.0.0", "::") else route_address("192.0.2.1", 9))
        self.shm_prefix = f"{SHM_PREFIX}{self.run_id}-"
        self.interrupted = False
        self.keys_dir = str(Path(config.keys).resolve()) if config.keys else ""
        self.curve = client_curve(Path(self.keys_dir)) if self.keys_dir else None
        #: the orchestrator this launcher started, once it answered (its id is in every StatusReport):
        #: the launcher talks to, counts and stops that one only, never another on the same port
        self.orchestrator_id = ""
        self.lane_inode: tuple[int, int] | None = None
        #: this launcher, as its roles tell the orchestrator (Register.launcher): a join launcher stops its own
        self.launcher_id = f"{self.host_id}/{os.getpid()}"
        #: this run's record, locked while this launcher lives (disagg/launcher/leftovers.py)
        self.record = RunRecord(self.run_id)

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

    def claim_run(self) -> list[str]:
        """Before anything is started: remove what deployments killed whole left on this machine (their pools and
        lane sockets; never a live one's), and record this run so a later launch can do the same for it. What was
        removed, in words (once; later calls: nothing)."""
        if self.record.fd is not None:
            return []
        said = remove_leftovers(mine=self.run_id)
        for line in said:
            log.info("%s", line)
        self.record.claim()
        if self.config.lane and not self.config.join:
            self.record.update(lane=lane_path(self.config.port))
        return said

    def start_processes(self) -> None:
        """Spawn the orchestrator, wait until it answers, then spawn every role."""
        c = self.config
        self.claim_run()
        self.start_fork_server()
        self.supervisor.spawn(
            "orchestrator",
            self.supervisor.python("disagg.orchestrator", encode(self.orchestrator_settings())),
            env=self._env(),
        )
        self._wait_reachable()
        if c.http.port:
            self.spawn_gateway()
        for p in self.placements:
            self.spawn_role(p)

    def forkable(self, p: Placement) -> bool:
        """A role the fork server may start: one without a GPU (CUDA's state must not be inherited)."""
        return self.config.fork_server and not self.visible_gpus(p) and not any(g is not None for g in p.rank_gpus or ())

    def start_fork_server(self) -> None:
        """Where it pays: one role forked from it costs as much as one started fresh."""
        if sum(self.forkable(p) for p in self.placements) >= 2:
            self.supervisor.start_fork_server(self.config.model, self._env())

    def orchestrator_settings(self) -> OrchestratorSettings:
        c = self.config
        fields = schema_part(c, "orchestrator")
        fields["keys"] = self.keys_dir  # resolved: the orchestrator runs in another folder
        fields["loras"] = self.loras_resolved()
        return OrchestratorSettings(
            **fields, deployment_id=self.run_id, host_id=self.host_id,
            model_identity=msgspec.convert(model_identity(c.model, c.dtype), ModelIdentity),
            standby={role: c.role(role).standby for role in ("encoder", "denoiser", "decoder")},
            sim=c.model.startswith("sim:"),
        )

    def loras_resolved(self):
        """The loras section with its paths made absolute: the orchestrator and roles run in other folders."""
        loras = self.config.loras
        if not loras.dir and not loras.adapters:
            return loras
        def absolute(p: str) -> str:
            return str(Path(p).expanduser().resolve()) if Path(p).expanduser().exists() else p  # else a hub id
        return msgspec.structs.replace(loras, dir=absolute(loras.dir) if loras.dir else "",
                                       adapters={k: absolute(v) for k, v in loras.adapters.items()})

    def spawn_gateway(self) -> Child:
        """The HTTP gateway: a client of our orchestrator, supervised like a role. Its API key travels in the
        environment, not on the command line (where `ps` shows it)."""
        settings, secrets = gateway_settings(self.config, self.endpoint, self.keys_dir)
        env = {**self._env(), **secrets}
        return self.supervisor.spawn("gateway", self.supervisor.python("disagg.gateway", encode(settings)), env=env)

    @property
    def http_url(self) -> str:
        h = self.config.http
        return f"http://{h.host}:{h.port}" if h.port else ""

    def take_orders(self, client: Client) -> list[str]:
        """Ask the orchestrator for this launcher's orders (rebalance: auto) and carry them out: each names an
        instance of ours it drained and told to exit, and the role its device serves from now on. What was done,
        in words."""
        try:
            orders = client.launcher_poll(self.launcher_id, timeout_s=2, ids=self.instance_ids(),
                                          idle=self.idle_devices()).orders
        except (Unreachable, RuntimeError):
            return []
        said = []
        for order in orders:
            old = self.supervisor.children.get(order.instance_id)
            if order.new_id in self.supervisor.children or old is None:
                continue  # started already, or not ours
            p = next((p for p in self.placements if p.instance_id == order.instance_id), None)
            if p is None:
                continue
            with self.supervisor.lock:  # its thread walks (and restarts) the children
                if old.proc is not None and old.proc.poll() is None:
                    continue  # on its way out, or restarted after a crash (its orchestrator calls the move off)
                self.supervisor.retire(old)  # crashed on its way out: its pending restart would share the device
                new = rerole(self.config, p, order.role, order.new_id)
                self.placements[self.placements.index(p)] = new
                child = self.spawn_role(new, take_spare=True)
            said.append(f"{order.instance_id}'s device serves as {order.new_id} now (pid {child.pid})")
        return said

    def instance_ids(self) -> list[str]:
        """Every instance id this launcher started, running or ended (a move never takes one again)."""
        return [name for name in self.supervisor.children if name not in ("orchestrator", "gateway")][:4096]

    def idle_devices(self) -> list[IdleDevice]:
        """Devices whose instance exited for a move and that no order has given a new role yet."""
        return [IdleDevice(instance_id=p.instance_id, role=p.role) for p in self.placements
                if (c := self.supervisor.children.get(p.instance_id)) is not None and c.moved]

    def sim_device(self, p: Placement) -> dict:
        """A sim model's instance: its slowdown (sim_slowdown, over its device class's speed) and its device's class
        and memory, where `devices` declares them."""
        slowdown = self.config.sim_slowdown.get(p.instance_id, 1.0)
        devices = parse_devices(self.config.devices) if self.config.devices and p.simulated else []
        if not devices or p.gpu is None:
            return {"sim_slowdown": slowdown}
        cls = devices[p.gpu]
        return {"sim_slowdown": slowdown / cls.speed, "device_class": cls.name, "device_memory_bytes": cls.memory_bytes}

    def spawn_role(self, p: Placement, take_spare: bool = False) -> Child:
        c = self.config
        spec = WorkerSpec(
            **schema_part(c, "role"),
            role=p.role, instance_id=p.instance_id, endpoint=self.role_endpoint, device=p.device,
            capacity=p.capacity, max_batch=p.max_batch, **self.sim_device(p),
            pool_bytes=p.pool_bytes, pool_name=f"{self.shm_prefix}{p.instance_id}", host_id=self.host_id,
            threads=p.threads, data_host=self.data_host, visible_gpus=self.visible_gpus(p),
            deployment_id=self.deployment_id, pool_limits=self.pool_limits(), launcher_id=self.launcher_id,
        )
        spec.transfer_protocol, spec.keys = c.protocol, self.keys_dir
        shown = [p.gpu] + [g for g in c.all_gpus() if g != p.gpu] if p.gpu is not None else []
        spec.gpu_ids = cuda_env(shown, dict(os.environ))[CUDA_VISIBLE_DEVICES] if shown else ""
        if spec.compile.enabled and not spec.compile.cache_dir:  # this deployment's: its restarts and spares find it
            spec.compile = msgspec.structs.replace(spec.compile, cache_dir=str(self.run_dir / "inductor"))
        if p.world > 1:
            return self._spawn_group(p, spec)
        env = self._env()
        env.update(cuda_env(spec.visible_gpus, dict(os.environ)))
        env[OMP_NUM_THREADS] = str(p.threads)
        return self.supervisor.spawn(
            p.instance_id, self.supervisor.python("disagg.roles", encode(spec)), env=env, cpus=p.cpus,
            spare_ok=True, fork_ok=self.forkable(p), take_spare=take_spare,
        )

    def _spawn_group(self, p: Placement, spec: WorkerSpec) -> Child:
        """An instance over several ranks: rank 0 (the instance the orchestrator knows) and its followers
        (INSTANCE.rN), one process and device each, restarted together when any of them dies."""
        gpus = p.rank_gpus or [None] * p.world
        devices = [f"gpu{g}" if g is not None else "cpu" for g in gpus]
        first = None
        for rank, gpu in enumerate(gpus):
            visible = [gpu] + [g for g in self.config.all_gpus() if g != gpu] if gpu is not None else []
            rank_spec = msgspec.structs.replace(spec, rank=rank, parallel=p.layout, group_devices=devices,
                                                visible_gpus=visible, device="cuda:0" if gpu is not None else "cpu")
            env = self._env()
            env.update(cuda_env(visible, dict(os.environ)))
            env[OMP_NUM_THREADS] = str(p.threads)
            name = p.instance_id if rank == 0 else f"{p.instance_id}.r{rank}"
            child = self.supervisor.spawn(name, self.supervisor.python("disagg.roles", encode(rank_spec)),
                                          env=env, cpus=p.cpus, spare_ok=True, group=p.instance_id,
                                          fork_ok=self.forkable(p))
            first = first or child
        return first

    def pool_limits(self) -> dict[str, int]:
        """Each role's smallest pool: the first stage refuses a request that would not fit one."""
        limits: dict[str, int] = {}
        for p in self.placements:
            limits[p.role] = min(limits.get(p.role, p.pool_bytes), p.pool_bytes)
        return limits

    def visible_gpus(self, p: Placement) -> list[int]:
        """The role's own GPU first (its cuda:0), then the host's other GPUs, for CUDA IPC to peers."""
        if p.gpu is None or p.simulated:
            return []
        return [p.gpu] + [g for g in self.config.all_gpus() if g != p.gpu]

    def _env(self) -> dict[str, str]:
        path = os.environ.get(PYTHONPATH)
        return {
            PYTHONUNBUFFERED: "1",
            PYTHONPATH: PROJECT_ROOT + (os.pathsep + path if path else ""),
            # a Hugging Face id: each role downloads its own weights (as the launcher fetched the configs), unless
            # the launcher's environment says offline; anything else never needs the hub
            HF_HUB_OFFLINE: os.environ.get(HF_HUB_OFFLINE, "0" if _hub_id(self.config.model) else "1"),
            MC_LOG_LEVEL: os.environ.get(MC_LOG_LEVEL, "ERROR"),
            DISAGG_RUN_ID: self.run_id,
        }

    def supervise(self, spares: bool = True) -> None:
        """From now on dead children are restarted (before, any death stops the launch), a role by a spare
        interpreter when one waits (started now, once the deployment's own imports are done; not for a
        batch run, which would pay its imports for nothing)."""
        if spares and self.placements and not self.config.colocated:
            self.supervisor.keep_spares(self.config.spares, self.supervisor.python("disagg.roles", "--spare"), self._env())
        self.supervisor.start_supervising()

    def follow(self, report: StatusReport) -> None:
        """`report` came from the orchestrator this launcher runs: remember its id and lane file."""
        if report.orchestrator.get("id") != self.orchestrator_id:
            self.orchestrator_id = str(report.orchestrator.get("id", ""))
            self.lane_inode = _inode(str(report.orchestrator.get("lane", "")))
            if self.lane_inode is not None:
                self.record.update(lane_inode=list(self.lane_inode))

    def status(self, client: Client) -> StatusReport | None:
        try:
            return client.status(timeout_s=2)
        except Unreachable:
            return None

    def shutdown(self) -> None:
        """Ask our orchestrator to stop the roles, then make sure every process and segment is gone.

        Only ours: after `disagg stop` another deployment may already hold the port, so the Stop names
        our orchestrator's id, goes out only while that process runs, and the lane file is removed only
        when it is still the one our orchestrator made and nothing listens on it."""
        self.supervisor.stop_supervising()
        orchestrator = self.supervisor.children.get("orchestrator")
        if orchestrator is not None and orchestrator.proc.poll() is None and self.orchestrator_id:
            try:
                with self.client() as client:
                    report = client.status(timeout_s=1)
                    if report.orchestrator.get("pid") == orchestrator.pid:  # ours, maybe restarted since we looked
                        self.follow(report)
                    client.stop(timeout_s=1, orchestrator_id=self.orchestrator_id)
                # the roles and the orchestrator end as told; the gateway is a client, told nothing: stop_all ends it
                deadline = time.monotonic() + 3
                while [c for c in self.supervisor.running() if c.name != "gateway"] and time.monotonic() < deadline:
                    time.sleep(0.05)
            except (Unreachable, RuntimeError):
                pass
        self.supervisor.stop_all()
        path = lane_path(self.config.port)
        # a killed orchestrator leaves its lane's socket file behind
        if self.lane_inode is not None and _inode(path) == self.lane_inode and not lane_in_use(path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        leftover = remove_segments(self.shm_prefix)
        if leftover:
            log.info("removed %d shared-memory segments left by killed processes", len(leftover))
        self.record.release()


def _hub_id(model: str) -> bool:
    """Whether `model` names a checkpoint on the Hugging Face hub (owner/name, not a local folder)."""
    return (not model.startswith(("sim:", ".", "/", "~")) and model.count("/") == 1
            and not Path(model).expanduser().exists())


def _inode(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
