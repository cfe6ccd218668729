"""The Router's handling of instances coming and going: instances lost (silent, stalled, exited) and their
work moved, standbys, drained and stopped hosts and deployments, work a re-registered instance no longer
runs; the Register, Heartbeat and Dead messages. A mixin of Router (disagg/orchestrator/router.py):
it works on the Router's registry and calls its state machine steps (lose_instance, finish_run, retry)."""

from __future__ import annotations

import logging

from disagg.orchestrator.outbox import Out, to_client, to_instance
from disagg.orchestrator.registry import Instance
from disagg.orchestrator.stats import GATEWAY_SILENCE_S
from disagg.settings.devices import class_of
from disagg.transport.wire.messages import (
    HEARTBEAT_INTERVAL_S,
    Alive,
    Cancel,
    Dead,
    ErrorCode,
    Heartbeat,
    Register,
    Registered,
    Rejected,
    Shutdown,
    Stop,
    StopHost,
    Stopping,
)

log = logging.getLogger("disagg.orchestrator")

#: what a request still waiting or running is told when the deployment stops under it
STOPPING_ERROR = "the deployment is stopping; the request was not finished"


class InstanceLifecycle:
    """Methods of Router; see disagg/orchestrator/router.py for the state they use."""

    # --- an instance registers, beats, reports its own death ------------------------------------

    def handle_register(self, sender, msg: Register, frames, now, out) -> None:
        if sender != msg.instance_id:
            out.append(to_instance(sender, Rejected(reason=f"socket identity {sender!r} != instance_id")))
            return
        ours = self.config.deployment_id
        if ours and msg.deployment_id != ours:
            log.warning("refused %s (pid %d): it belongs to deployment %r, this orchestrator serves %r",
                        msg.instance_id, msg.pid, msg.deployment_id, ours)
            out.append(to_instance(sender, Rejected(reason=f"another deployment: this orchestrator serves "
                                                          f"deployment {ours!r}, not {msg.deployment_id!r}",
                                                    code=ErrorCode.FOREIGN_DEPLOYMENT)))
            return
        foreign = self.foreign_model(msg)
        if foreign:
            log.warning("refused %s (pid %d): %s", msg.instance_id, msg.pid, foreign)
            out.append(to_instance(sender, Rejected(reason=foreign, code=ErrorCode.FOREIGN_MODEL)))
            return
        old = self.registry.get(msg.instance_id)
        if old is not None and old.state != "dead":
            self.lose_instance(old, "it registered again (restarted)", now, out)
        inst = self.registry.register(msg, now)
        self.unserved_since.pop(inst.role, None)
        self.instances_changed()
        # work still computing from before: its slots stay taken until it reports
        inst.running = dict(msg.busy)
        inst.inherited = dict(msg.busy)
        inst.free_slots = max(0, inst.capacity - len(inst.running))
        if inst.state == "ready":
            inst.state = self.serving_or_standby(inst)
        if inst.role == self.first_stage:
            self.limits = {"max_width": msg.max_width, "max_height": msg.max_height, "max_frames": msg.max_frames}
            self.limited = any(self.limits.values())
        log.info("registered %s (%s, pid %d, %s, capacity %d)", inst.id, inst.role, inst.pid, inst.device, inst.capacity)
        self.warn_unavailable_engines(inst)
        out.append(
            to_instance(
                inst.id,
                Registered(session=inst.session, heartbeat_interval_s=HEARTBEAT_INTERVAL_S, orchestrator_id=self.id,
                           lane=self.lane),
            )
        )
        # what it holds and computes for requests not known here is kept for their clients (a restart)
        self.recovery.on_register(inst, msg, now, out)

    def handle_heartbeat(self, sender, msg: Heartbeat, frames, now, out) -> None:
        inst = self.registry.get(sender)
        inst.pool_free_bytes = msg.pool_free_bytes
        if msg.components:
            inst.components = msg.components
        inst.steps = msg.steps
        inst.computed = msg.computed
        if inst.inherited:
            self.settle_inherited(inst, set(msg.running), now, out)
        if msg.batch_steps:
            inst.batch_steps = msg.batch_steps
        if msg.lora is not None:
            self.registry.set_lora(inst, msg.lora)
        if msg.conditioning is not None:
            inst.conditioning = msg.conditioning
        if msg.boot is not None:
            inst.boot = msg.boot
        if msg.compile is not None:
            inst.compile = msg.compile
        if msg.memory is not None:
            if msg.memory.device != inst.memory.device:
                cls = class_of(msg.memory.device)
                inst.device_class, inst.speed = (cls.name, cls.speed) if cls is not None else ("", 1.0)
            inst.memory = msg.memory
        if msg.progress != inst.progress:
            inst.progress, inst.progress_at = msg.progress, now
        out.append(to_instance(inst.id, Alive(orchestrator_id=self.id, forget_pools=self.gone_pools(msg.peer_pools))))
        if msg.ready and inst.state == "starting":
            inst.state = self.serving_or_standby(inst)
            self.instances_changed()
            log.info("%s %s", inst.id, "ready" if inst.state == "ready" else "ready, as a standby")

    def warn_unavailable_engines(self, inst: Instance) -> None:
        """An engine that applies to an instance's pool and could not start there is an operator's problem, not a
        detail of its log: without it, hand-offs that need it (a GPU pool to another host: Mooncake) go inline
        through the orchestrator. Said once per instance, engine and reason; status, the table and /metrics show
        it as long as the instance lives."""
        for engine, reason in sorted(inst.unavailable_engines.items()):
            key = (inst.id, engine, reason)
            if key in self._warned_engines:
                continue
            self._warned_engines.add(key)
            note = (f"{inst.id} ({inst.device} pool on {inst.host}): {engine} unavailable: {reason}; its hand-offs that "
                    f"need {engine} go inline through the orchestrator")
            log.warning("%s", note)
            self.warnings.append(note)

    def gone_pools(self, mapped: list[str]) -> list[str]:
        """Of the pools a role holds mapped, those no live instance owns: a dead one's, a restarted one's old pool,
        one that moved to another role (a new id, a new pool). A role that keeps them keeps their memory."""
        if not mapped:
            return []
        live = {i.pool.pool_name for i in self.registry.alive()}
        return [name for name in mapped if name not in live]

    def handle_dead(self, sender, msg: Dead, frames, now, out) -> None:
        self.lose_instance(self.registry.get(sender), f"it reported: {msg.reason}", now, out)

    def handle_stop_host(self, identity, msg: StopHost, frames, now, out) -> None:
        insts = [i for i in self.registry.alive() if i.host == msg.host_id and msg.launcher in ("", i.launcher)]
        if not insts:
            hosts = sorted({i.host for i in self.registry.alive()})
            mine = f" started by launcher {msg.launcher}" if msg.launcher else ""
            out.append(to_client(identity, Rejected(reason=f"no live instance{mine} on host {msg.host_id!r}; hosts: "
                                                          f"{', '.join(hosts) or 'none'}")))
            return
        out.append(to_client(identity, Stopping()))
        log.info("%s host %s: %s", "draining" if msg.drain else "stopping", msg.host_id, ", ".join(i.id for i in insts))
        for inst in insts:
            if msg.drain:
                inst.state = "draining"  # no new work; shut down once idle (tick)
                self.instances_changed()
            else:
                out.append(to_instance(inst.id, Shutdown()))
                self.lose_instance(inst, f"its host {msg.host_id} was stopped", now, out)
        self.shutdown_drained(out, now)

    def foreign_model(self, msg: Register) -> str:
        """Why an instance that registers serves another model than the deployment ("" when it does not). The
        deployment's model is the launcher's (its settings' model_identity), else the first instance's that registered."""
        if msg.identity is None:
            return ""
        if self.model is None:
            self.model = msg.identity
            return ""
        if self.model.same_model(msg.identity):
            return ""
        return (f"another model: this deployment serves {self.model.describe()}; {msg.instance_id} serves "
                f"{msg.identity.describe()}")

    # --- roles without instances ----------------------------------------------------------------

    def note_served(self, now: float) -> None:
        """Which roles have no instance that serves or will (starting, ready, standby), and since when."""
        for role in self.pipeline_roles:
            if any(i.state in ("starting", "ready", "standby") for i in self.registry.of_role(role)):
                self.unserved_since.pop(role, None)
            else:
                self.unserved_since.setdefault(role, now)

    def not_ready(self, now: float) -> str:
        """Why Submits are refused now: a role without an instance for join_wait_s ("" when none is)."""
        if not self.unserved_since:  # (every Submit asks)
            return ""
        wait = self.config.join_wait
        gone = [(role, now - since) for role, since in self.unserved_since.items() if now - since >= wait]
        if not gone:
            return ""
        what = ", ".join(f"{role} (none for {s:.0f} s)" for role, s in gone)
        return f"not ready: no instance of {what}; retry once one has joined (join_wait {wait:g} s)"

    def fail_unserved(self, now: float, out) -> None:
        """Requests waiting for a role that has had no instance for join_wait_s fail now, not at their timeout."""
        why = self.not_ready(now)
        if not why:
            return
        for role, since in self.unserved_since.items():
            if now - since < self.config.join_wait:
                continue
            for rid in list(self.queues[role]):
                req = self.requests.get(rid)
                if req is not None and req.state == "queued" and req.stage == role:
                    self.release_source(req, out)
                    self.fail(req, f"refused: {why}", now, out, code=ErrorCode.NOT_READY)

    def drop_silent_gateways(self, now: float, out) -> None:
        """A gateway silent for twice GATEWAY_SILENCE_S (it beats every second) is gone, killed: the requests only
        it waited for are cancelled, so they stop computing (its HTTP clients retried them elsewhere, or gave up)."""
        gone = [k for k, (_, seen) in self.gateways.items() if now - seen > 2 * GATEWAY_SILENCE_S]
        for identity in gone:
            del self.gateways[identity]
            orphans = [rid for rid, req in self.requests.items() if identity in req.clients]
            if orphans:
                log.warning("gateway %s went silent: cancelling %d requests only it waited for", identity[:24], len(orphans))
            for rid in orphans:
                self.handle_cancel(identity, Cancel(request_id=rid), (), now, out)

    def shutdown_drained(self, out, now: float) -> None:
        """Draining instances that run and hold nothing any more are told to exit."""
        for inst in self.registry.alive():
            if inst.state == "draining" and not inst.running and not inst.staged:
                moving = inst.id in self.rebalance.moving
                out.append(to_instance(inst.id, Shutdown(move=moving)))
                self.lose_instance(inst, "drained", now, out, moving=moving)

    def serving_or_standby(self, inst: Instance) -> str:
        """The state of an instance that just became ready: a standby while its role has fewer standbys
        than wanted and someone else serves; else ready. Work it holds makes it serve."""
        want = self.config.standby.get(inst.role, 0)
        if not want or inst.running:
            return "ready"
        peers = [i for i in self.registry.of_role(inst.role) if i is not inst and i.state != "dead"]
        standbys = sum(i.state == "standby" for i in peers)
        serving = sum(i.state in ("ready", "starting") for i in peers)
        return "standby" if standbys < want and serving >= 1 else "ready"

    def promote_standby(self, dead: Instance) -> None:
        """A serving instance died: a standby of its role takes its place at once (its replacement, once
        restarted, becomes the new standby)."""
        standby = next((i for i in self.registry.of_role(dead.role) if i.state == "standby"), None)
        if standby is not None:
            standby.state = "ready"
            log.warning("standby %s takes over from %s", standby.id, dead.id)

    def settle_inherited(self, inst: Instance, running: set[str], now: float, out: list[Out]) -> None:
        """Work it ran when it registered (Register.busy) and runs no more, one heartbeat later: had its
        report come, it would have closed the run. The slot comes back; a request resumed as running there
        (disagg/orchestrator/parts/recovery.py) whose report never came gets a new attempt."""
        for rid in set(inst.inherited) - running:
            attempt = inst.inherited[rid]
            if inst.running.get(rid) != attempt:  # reported, or a new attempt was sent here since
                del inst.inherited[rid]
                inst.vanished.pop(rid, None)
                continue
            if now - inst.vanished.setdefault(rid, now) < HEARTBEAT_INTERVAL_S / 2:
                continue  # its report may still be on its way (compute threads report on their own sockets)
            del inst.inherited[rid]
            del inst.vanished[rid]
            req = self.finish_run(inst, rid, attempt)
            if req is not None and req.state == "running":
                self.retry(req, f"{inst.id} no longer runs it, and its report was lost", now, out)

    def instance_exited(self, instance_id: str, pid: int, now: float) -> list[Out]:
        """The process of an instance is gone (its same-host lane closed and its pid has exited): its work
        moves elsewhere now, not after the heartbeat timeout."""
        out: list[Out] = []
        inst = self.registry.get(instance_id)
        if inst is not None and inst.state != "dead" and inst.pid == pid:
            self.lose_instance(inst, f"its process {pid} exited", now, out)
            self.dispatch_queued(now, out)
        return out

    def handle_stop(self, identity, msg: Stop, frames, now, out) -> None:
        if msg.orchestrator_id and msg.orchestrator_id != self.id:
            # a launcher stopping the orchestrator it started, which is gone: this one took its port
            log.warning("refused a Stop meant for orchestrator %s (this is %s)", msg.orchestrator_id, self.id)
            out.append(to_client(identity, Rejected(reason=f"this is orchestrator {self.id}, not "
                                                          f"{msg.orchestrator_id}: not stopping")))
            return
        out.append(to_client(identity, Stopping()))
        if msg.drain and self.requests:
            self.draining = True  # refuse new work; stop once the last request ends (see end)
            log.info("draining %d requests before stopping", len(self.requests))
            return
        self.stop_all(out, now)

    def stop_all(self, out, now: float) -> None:
        """Tell every instance to exit, and every client with a request in flight that it ends now."""
        self.stopping = True
        for inst in self.registry.alive():
            out.append(to_instance(inst.id, Shutdown()))
        for req in list(self.requests.values()):
            self.fail(req, STOPPING_ERROR, now, out, stopping=True, code=ErrorCode.UNAVAILABLE)

    def expire_instances(self, now: float, out: list[Out]) -> None:
        for inst in self.registry.alive():
            silent = now - inst.last_seen
            if silent > self.config.timeouts.heartbeat:
                self.lose_instance(inst, f"no heartbeat for {silent:.1f} s", now, out)
            elif inst.running and now - inst.progress_at > self.config.timeouts.stall:
                self.lose_instance(inst, f"no progress for {now - inst.progress_at:.1f} s while holding work", now, out)

    def lose_instance(self, inst: Instance, why: str, now: float, out: list[Out], moving: bool = False) -> None:
        """Mark an instance dead; every request it held or whose data it held gets a new attempt. `moving`: it
        drained and stopped for a planned move (rebalance), which the log says, not a loss."""
        if moving:
            move = self.rebalance.moving[inst.id]
            log.info("instance %s drained and stopped to move: its device becomes %s (%s)", inst.id, move.new_id,
                     move.to_role)
        else:
            log.warning("instance %s is dead: %s", inst.id, why)
        self.instances_changed()
        if inst.state == "ready":
            self.promote_standby(inst)
        inst.state, inst.free_slots = "dead", 0
        inst.running.clear()
        inst.staged.clear()
        self.recovery.forget_instance(inst.id)
        for req in list(self.requests.values()):
            held = req.assigned == inst.id and req.state == "running"
            staged_here = req.source is not None and req.source.slot.instance_id == inst.id
            if staged_here:
                req.source, req.source_frames = None, []  # its pool went with it
            if held or staged_here:
                self.retry(req, f"{inst.role} {inst.id} died ({why}) during stage {req.stage}", now, out)
