"""`disagg launch --join tcp://HEAD:PORT`: a host that runs only role processes, registered with another
host's orchestrator, and supervised here."""

from __future__ import annotations

import logging
import time

import msgspec

from disagg.client import Unreachable
from disagg.launcher.deployment import BootError, Deployment
from disagg.launcher.hosts import parse_endpoint, route_address
from disagg.settings import Settings
from disagg.transport.data.shm import remove_segments
from disagg.transport.wire.messages import StatusReport

log = logging.getLogger("disagg.launcher")

#: how long a join host's Ctrl-C lets its roles finish what they run before they are stopped anyway
DRAIN_S = 10.0


class JoinDeployment(Deployment):
    """This host's roles of a deployment whose orchestrator runs elsewhere. Instance ids carry the host
    (denoiser-0@HOST), so the roles of many hosts never collide."""

    def __init__(self, config: Settings, run_dir=None):
        super().__init__(config, run_dir)
        head, port = parse_endpoint(config.join)
        self.endpoint = config.join
        self.role_endpoint = f"tcp://{head}:{port + 1}"
        self.data_host = config.advertise_host or route_address(head, port)
        self.deployment_id = ""  # the head's, learnt from its status
        # the head's same-host fast lane is not on this host (where /tmp is shared, as between network
        # namespaces, it would be a shortcut real hosts do not have): control messages take ZeroMQ
        config.lane = False
        for p in self.placements:
            p.instance_id = f"{p.instance_id}@{self.host_id}"

    def start_processes(self) -> None:
        self.claim_run()
        report = self._head_status(timeout_s=30)
        self.deployment_id = str(report.orchestrator.get("deployment_id", ""))
        self.follow(report)
        if report.orchestrator.get("host_id") == self.host_id:
            log.info("the head runs on this host too: its instances and ours share memory; Ctrl-C here stops only "
                     "the roles this launcher started")
        log.info("joining deployment %s at %s as host %s (%s)", self.deployment_id, self.endpoint, self.host_id,
                 self.data_host)
        self.start_fork_server()  # the model is the head's now
        for p in self.placements:
            self.spawn_role(p)

    def _head_status(self, timeout_s: float) -> StatusReport:
        deadline = time.monotonic() + timeout_s
        with self.client() as client:
            while True:
                if self.interrupted:
                    raise KeyboardInterrupt
                try:
                    return client.status(timeout_s=2)
                except Unreachable as exc:
                    if time.monotonic() > deadline:
                        raise BootError(f"no orchestrator to join at {self.endpoint}: {exc}") from None
                except RuntimeError as exc:  # refused: e.g. it wants keys
                    raise BootError(f"the orchestrator at {self.endpoint} refused us: {exc}") from None
                time.sleep(0.5)

    def wait_ready(self, on_status=None) -> StatusReport:
        def only_here(report: StatusReport) -> StatusReport:
            return self.local(report)

        return super().wait_ready(on_status=(lambda r: on_status(only_here(r))) if on_status else None,
                                  any_orchestrator=True)

    def local(self, report: StatusReport) -> StatusReport:
        """`report` with this host's instances only (the join host's live table)."""
        return msgspec.structs.replace(report, instances=[i for i in report.instances if i.host == self.host_id],
                                       gateways=[])  # the head's gateway is not this host's

    def shutdown(self) -> None:
        """Stop this host's roles only: the head drains them (no new work; they exit once what they run and
        hold is done, at most DRAIN_S), then whatever is left is stopped here. The rest of the deployment
        goes on; work still here moves elsewhere."""
        self.supervisor.stop_supervising()
        if self.supervisor.running():
            try:
                with self.client() as client:
                    client.stop_host(self.host_id, drain=True, timeout_s=2, launcher=self.launcher_id)
                deadline = time.monotonic() + DRAIN_S
                while self.supervisor.running() and time.monotonic() < deadline:
                    time.sleep(0.1)
            except (Unreachable, RuntimeError) as exc:
                log.info("the head did not drain this host (%s); stopping its roles", exc)
        self.supervisor.stop_all()
        leftover = remove_segments(self.shm_prefix)
        if leftover:
            log.info("removed %d shared-memory segments left by killed processes", len(leftover))
        self.record.release()
