"""`rebalance`: pools that size themselves. Every `interval_s` the throughput model (disagg/orchestrator/parts/planner.py)
takes the last `window_s` of requests and the measured stage times and recommends the split of the devices
between the roles that serves the most (`advise`); under `auto` devices then move to it:

1. an instance of a role with too many devices is set `draining` (no new work; it finishes what it runs and
   holds, and is told to exit: `shutdown_drained`);
2. once it is gone, its launcher's next LauncherPoll is answered with a Rerole: start `new_id` as the role with
   too few devices on that device;
3. the move is over when `new_id` is ready. Then `cooldown_s` passes before the next move.

A move is called off when the instance it drains registers again before its launcher took the order: it crashed
(or was killed) on its way out and its supervisor restarted it, so its device serves its old role; the launcher
retires a crashed instance whose order it takes first (disagg/launcher/deployment.py: take_orders).

A move outlives the orchestrator that made it: the instance exits with MOVE_EXIT (Shutdown.move), and its
launcher reports the device as idle in every LauncherPoll until an order gives it a role. A successor that finds
such a device takes it up as a move of its own (`adopt_idle`): to the role the plan lacks most, else back to the
role it left. New ids never repeat one the deployment used: launchers report every id they started (`ids`).

Devices of several classes (every instance's heartbeat names a device of a known class) are planned per class
(`split_by_class`, planner.plan_by_class), from stage times in H200-seconds, and each moves within its class.

Only instances of a launcher that polled in the last LAUNCHER_SILENCE_S move (a launcher that does not poll
could not start them again), on one device each, and only to a role whose footprint fits their device's memory.
"""

from __future__ import annotations

import collections
import logging
import math
from dataclasses import dataclass

from disagg.orchestrator.outbox import to_client
from disagg.orchestrator.parts.base import Part
from disagg.orchestrator.parts.planner import ROLES, Plan, Work, fmt, fmt_classes, plan, plan_by_class
from disagg.orchestrator.scheduling.deadlines import shape
from disagg.settings.choices import RebalanceMode
from disagg.settings.devices import CLASSES
from disagg.transport.wire.messages import LauncherPoll, RebalanceStatus, Rerole, Reroles, RoleMove, SplitRate

log = logging.getLogger("disagg.orchestrator")

#: a launcher not heard from this long takes no orders (its instances do not move)
LAUNCHER_SILENCE_S = 5.0
#: a move whose new instance is not ready this long after its order is given up (its device is lost to the plan)
RESTART_TIMEOUT_S = 120.0
#: the window's requests are counted per bucket of this many seconds
BUCKET_S = 1.0


@dataclass
class Move:
    inst: str
    new_id: str
    from_role: str
    to_role: str
    launcher: str
    started: float
    state: str = "draining"
    ordered_at: float = 0.0
    #: the registration of `inst` that was drained (0: an adopted device, none): another one means it restarted
    session: int = 0
    #: its device's class, where the plan was by class ("" otherwise)
    device_class: str = ""


class Rebalance(Part):
    """A part of the Router (disagg/orchestrator/parts/base.py): the window of requests, the plan, and the moves. It owns
    the launchers' LauncherPoll."""

    messages = {LauncherPoll: "handle_launcher_poll"}

    def __init__(self, core):
        self.core = core
        self.config = core.config
        self.registry = core.registry
        #: (bucket start, {shape key: [params, count]}), oldest first
        self.arrivals: collections.deque = collections.deque()
        self.launchers: dict[str, float] = {}
        self.plan: Plan | None = None
        self.plan_work: Work | None = None
        self.next_plan = 0.0
        self.moving: dict[str, Move] = {}
        self.moves_done = 0
        self.last_move_end: float | None = None
        #: (when it ended, from role, to role, device class) of the moves of the last cooldown_s: a move back (on a
        #: device of the same class) is held that long
        self.recent: collections.deque = collections.deque()
        self.holding = ""
        #: instance id -> its device's class (Instance.device_class), or a move's new instance's (before its first
        #: heartbeat names it)
        self.classes: dict[str, str] = {}
        #: launcher -> every instance id it started (LauncherPoll.ids): never a move's new id
        self.launcher_ids: dict[str, frozenset[str]] = {}

    @property
    def mode(self) -> RebalanceMode:
        return RebalanceMode.OFF if self.config.colocated else self.config.rebalance.mode

    # --- inputs ---------------------------------------------------------------------------------

    def submitted(self, req, now: float) -> None:
        self.note_arrival(req.params, now)

    def note_arrival(self, params, now: float) -> None:
        if self.mode == RebalanceMode.OFF:
            return
        start = math.floor(now / BUCKET_S) * BUCKET_S
        if not self.arrivals or self.arrivals[-1][0] != start:
            self.arrivals.append((start, {}))
        key = (*shape(params), params.num_inference_steps, params.previews or 0)
        entry = self.arrivals[-1][1].get(key)
        if entry is None:
            self.arrivals[-1][1][key] = [params, 1]
        else:
            entry[1] += 1

    def handle_launcher_poll(self, identity, msg, frames, now, out) -> None:
        self.launchers[msg.launcher] = now
        self.launcher_ids[msg.launcher] = frozenset(msg.ids)
        if msg.idle and self.mode == RebalanceMode.AUTO and not self.core.stopping:
            self.adopt_idle(msg.launcher, msg.idle, now)
        orders = [Rerole(instance_id=m.inst, new_id=m.new_id, role=m.to_role) for m in self.moving.values()
                  if m.launcher == msg.launcher and m.state == "restarting"]
        out.append(to_client(identity, Reroles(orders=orders)))

    # --- the plan -------------------------------------------------------------------------------

    def movable(self, inst, now: float) -> bool:
        """On one device, and (under auto) started by a launcher that takes orders (advise counts every such
        device: it recommends for the budget, whoever would move it)."""
        if len(inst.devices) > 1:
            return False
        if self.mode != RebalanceMode.AUTO:
            return True
        return bool(inst.launcher) and now - self.launchers.get(inst.launcher, -math.inf) <= LAUNCHER_SILENCE_S

    def split_now(self, now: float, moving: bool = True) -> tuple[dict[str, int], dict[str, int]]:
        """Devices per role (a device being moved counts for the role it moves to; with `moving` False, for none:
        what serves now) and those that cannot move."""
        current = {r: 0 for r in ROLES}
        fixed = {r: 0 for r in ROLES}
        away = {m.new_id for m in self.moving.values()} | self.moving.keys()
        # movable(), with what it asks of the settings and the launchers looked up once for every instance
        auto = self.mode == RebalanceMode.AUTO
        polling = {name for name, seen in self.launchers.items() if now - seen <= LAUNCHER_SILENCE_S}
        for role in ROLES:
            for inst in self.registry.of_role(role):
                if inst.state not in ("ready", "starting") or (away and inst.id in away):
                    continue
                current[role] += 1
                if len(inst.devices) > 1 or (auto and (not inst.launcher or inst.launcher not in polling)):
                    fixed[role] += 1
        for m in self.moving.values() if moving else ():
            current[m.to_role] += 1
        return current, fixed

    def split_by_class(self, now: float):
        """Where the devices are of several known classes (their heartbeats' MemoryStats.device): devices per class
        and role (a moving one counts for its new role), each class's speed, and the devices that cannot move. None
        where they are of one class, or any is of none known: the plan is then by counts (`split_now`)."""
        serving, fixed, speeds = {}, {}, {}
        away = {m.new_id for m in self.moving.values()} | self.moving.keys()
        for role in ROLES:
            for inst in self.registry.of_role(role):
                if inst.state not in ("ready", "starting") or inst.id in away:
                    continue
                if inst.device_class:
                    self.classes[inst.id] = inst.device_class
                name = self.classes.get(inst.id)
                if name is None:
                    return None
                speeds[name] = CLASSES[name].speed
                serving.setdefault(name, dict.fromkeys(ROLES, 0))[role] += 1
                fixed.setdefault(name, dict.fromkeys(ROLES, 0))
                if not self.movable(inst, now):
                    fixed[name][role] += 1
        if len(self.classes) > 2 * len(self.registry.by_id) + 64:  # forget instances long gone
            keep = self.registry.by_id.keys() | {m.new_id for m in self.moving.values()}
            self.classes = {i: c for i, c in self.classes.items() if i in keep}
        for m in self.moving.values():
            if m.device_class not in serving:
                return None  # a move planned by counts (the classes were not known then)
            serving[m.device_class][m.to_role] += 1
        if len(speeds) < 2:
            return None
        return serving, speeds, fixed

    def window_work(self, now: float, at_speed_1: bool = False) -> Work:
        """The window's mix and its seconds per request per role (`at_speed_1`: H200-seconds)."""
        while self.arrivals and self.arrivals[0][0] < now - self.config.rebalance.window_s:
            self.arrivals.popleft()
        merged: dict[tuple, list] = {}
        for _, bucket in self.arrivals:
            for key, (params, count) in bucket.items():
                entry = merged.setdefault(key, [params, 0])
                entry[1] += count
        fetch, slots = {}, {}
        for role in ROLES:
            n, total = self.core.stats.stage_times.get((role, "fetch"), (0, 0.0))
            fetch[role] = total / n if n else 0.0
            insts = [i for i in self.registry.of_role(role) if i.state != "dead"]
            slots[role] = max((i.capacity for i in insts), default=1)
        # only shapes every role has measured: a shape's first estimate, scaled from others (a video's decode from
        # images'), can be far off, and a split planned on it would be undone a moment later
        def measured(entry) -> bool:
            return all(self.core.deadlines.predictor.predict(r, entry[0], True, at_speed_1) is not None for r in ROLES)

        return Work.of([e for e in merged.values() if measured(e)], lambda r, p: self.work_of(r, p, at_speed_1),
                       fetch, slots)

    def work_of(self, role: str, params, at_speed_1: bool = False) -> float | None:
        """Predicted device seconds of `role` for a request: a decoder's counts each live preview the request asked
        for as one more decode of its size (previews.py: a preview is decoded on a decoder; videos take none)."""
        seconds = self.core.deadlines.predictor.predict(role, params, at_speed_1=at_speed_1)
        if seconds is not None and role == "decoder" and params.previews and not params.num_frames:
            seconds *= 1 + params.previews
        return seconds

    def tick(self, now: float, out) -> None:
        mode = self.mode
        if mode == RebalanceMode.OFF:
            return
        self.follow_moves(now)
        if now < self.next_plan:
            return
        self.next_plan = now + self.config.rebalance.interval_s
        by_class = self.split_by_class(now)
        work = self.window_work(now, at_speed_1=by_class is not None)  # by class: in H200-seconds
        current, fixed = self.split_now(now)
        self.plan_work = work
        if work.requests < self.config.rebalance.min_requests or not work.known:
            self.plan, self.holding = None, "too few requests measured in the window"
            return
        if by_class is None:
            self.plan = plan(work, current, self.config.rebalance.min_per_role, fixed)
        else:
            current_c, speeds, fixed_c = by_class
            self.plan = plan_by_class(work, current_c, speeds, self.config.rebalance.min_per_role, fixed_c)
        # advise never moves: nothing holds it back once a plan is made (the last "too few requests" is stale)
        self.holding = self.maybe_move(now) if mode == RebalanceMode.AUTO else ""

    def maybe_move(self, now: float) -> str:
        """Start the moves to the recommended split, or say why not now."""
        cfg, p = self.config.rebalance, self.plan
        if self.moving:
            return "moves in progress"
        if self.core.stopping or self.core.draining or self.core.recovering(now):
            return "the orchestrator is stopping or recovering"
        if p.best == p.current and p.best_classes == p.current_classes:
            return "the current split is the best"
        if p.gain <= cfg.min_gain:
            return f"gain {p.gain:.1%} is not over min_gain {cfg.min_gain:.0%}"
        while self.recent and now - self.recent[0][0] >= cfg.cooldown_s:
            self.recent.popleft()
        moves = p.class_moves()
        back = [(at, a, b) for at, a, b, cls in self.recent if (b, a, cls) in moves]
        if back:  # it would undo a recent move: hysteresis (moves onward, in the same direction, go at once)
            at, a, b = back[-1]
            return f"cooldown: a device moved {a} -> {b} {now - at:.0f} s ago ({cfg.cooldown_s - (now - at):.0f} s left)"
        started = []
        for from_role, to_role, device_class in moves:
            inst = self.pick_mover(from_role, to_role, now, device_class)
            if inst is None:
                continue
            new_id = self.new_instance_id(to_role, inst.id)
            self.moving[inst.id] = Move(inst.id, new_id, from_role, to_role, inst.launcher, now, session=inst.session,
                                        device_class=device_class)
            if device_class:
                self.classes[new_id] = device_class
            inst.state = "draining"  # no new work; shut down once idle (shutdown_drained)
            self.core.instances_changed()
            started.append(f"{inst.id} -> {new_id}")
        if not started:
            return "no instance can move (none movable, or the role's footprint does not fit)"
        log.info("rebalance %s -> %s (predicted %.2f -> %.2f req/s): %s",
                 fmt_classes(p.current_classes) or fmt(p.current), fmt_classes(p.best_classes) or fmt(p.best),
                 p.current_rps, p.best_rps, ", ".join(started))
        return ""

    def pick_mover(self, from_role: str, to_role: str, now: float, device_class: str = ""):
        """The instance of `from_role` (on a device of `device_class`, where given) with the least work in hand that
        can move and whose device fits `to_role`."""
        need = self.footprint(to_role)
        serving = [i for i in self.registry.of_role(from_role) if i.state in ("ready", "starting") and i.id not in self.moving]
        if len(serving) <= self.config.rebalance.min_per_role:
            return None
        cands = [i for i in serving if i.state == "ready" and self.movable(i, now) and self.fits(i, need)
                 and (not device_class or self.classes.get(i.id) == device_class)]
        return min(cands, key=lambda i: (self.work_in_hand(i, now), len(i.staged), i.id), default=None)

    @staticmethod
    def fits(inst, need: int) -> bool:
        """Whether `inst`'s device holds `need` bytes once `inst` has exited: what the device has free now (other
        processes on it, activations, caches counted) plus the weights and pool `inst` frees; where the device's
        free memory is unknown (the CPU, a simulated device), its total (0: unknown, no check)."""
        if inst.memory.free_bytes:
            return need <= inst.memory.free_bytes + inst.memory.weights_bytes + inst.pool.pool_bytes
        return not inst.memory_bytes or need <= inst.memory_bytes

    def work_in_hand(self, inst, now: float) -> float:
        """Predicted seconds until what `inst` runs is done (how long it would take to drain)."""
        return sum(self.core.deadlines.stage_left(req, inst.role, now) for rid in inst.running
                   if (req := self.core.requests.get(rid)) is not None)

    def footprint(self, role: str) -> int:
        """Bytes a device needs for `role`: its instances' largest weights plus pool (0 before any reported)."""
        return max((i.memory.weights_bytes + i.pool.pool_bytes for i in self.registry.of_role(role)
                    if i.state != "dead" and i.memory.weights_bytes), default=0)

    def new_instance_id(self, role: str, old_id: str) -> str:
        """The lowest `ROLE-k` (on the old instance's host) that no instance of the deployment ever had: not one
        this orchestrator knows, nor one a launcher started (a restarted orchestrator knows no retired ids)."""
        host = old_id[old_id.index("@"):] if "@" in old_id else ""
        taken = {m.new_id for m in self.moving.values()}.union(*self.launcher_ids.values())
        k = 0
        while f"{role}-{k}{host}" in taken or self.registry.get(f"{role}-{k}{host}") is not None:
            k += 1
        return f"{role}-{k}{host}"

    def adopt_idle(self, launcher: str, idle, now: float) -> None:
        """Devices of `launcher` whose instance exited for a move this orchestrator did not make (its predecessor
        died during the move): each becomes a move of this one's, so that every device of the launch serves."""
        for device in idle:
            if device.instance_id in self.moving:
                continue  # a move of ours: its order is on its way
            # its class: the instance it was, if this orchestrator heard it name its device
            device_class = self.classes.get(device.instance_id, "")
            to_role = self.role_lacking(device_class) or device.role
            new_id = self.new_instance_id(to_role, device.instance_id)
            self.moving[device.instance_id] = Move(device.instance_id, new_id, device.role, to_role, launcher, now,
                                                   state="restarting", ordered_at=now, device_class=device_class)
            if device_class:
                self.classes[new_id] = device_class
            self.core.warnings.append(f"rebalance: {device.instance_id}'s device was between roles when the orchestrator "
                                 f"restarted; it serves as {new_id} now")
            log.warning("rebalance: %s's device was left between roles by an orchestrator restart; its launcher starts "
                        "%s there", device.instance_id, new_id)

    def role_lacking(self, device_class: str = "") -> str | None:
        """The role the last plan wants most devices more of (of `device_class`, where planned by class), if any."""
        return self.plan.lacking(device_class) if self.plan is not None else None

    def follow_moves(self, now: float) -> None:
        for m in list(self.moving.values()):
            old = self.registry.get(m.inst)
            if m.session and old is not None and old.session != m.session and old.state != "dead":
                del self.moving[m.inst]  # restarted in its old role before its launcher took the order
                self.last_move_end = now
                self.core.warnings.append(f"rebalance: {m.inst} restarted during its move to {m.to_role}; it serves as "
                                          f"a {m.from_role} again, and the move is called off")
                log.warning("rebalance: %s restarted while moving to %s; the move is called off", m.inst, m.to_role)
            elif m.state == "draining" and (old is None or old.state == "dead"):
                m.state, m.ordered_at = "restarting", now
                log.info("rebalance: %s drained; its launcher starts %s there", m.inst, m.new_id)
            elif m.state == "restarting":
                new = self.registry.get(m.new_id)
                if new is not None and new.state in ("ready", "standby"):
                    del self.moving[m.inst]
                    self.moves_done += 1
                    self.last_move_end = now
                    self.recent.append((now, m.from_role, m.to_role, m.device_class))
                    log.info("rebalance: %s serves as a %s (was %s, a %s)", m.new_id, m.to_role, m.inst, m.from_role)
                elif now - m.ordered_at > RESTART_TIMEOUT_S:
                    del self.moving[m.inst]
                    self.last_move_end = now
                    self.core.warnings.append(f"rebalance: {m.new_id} did not start within {RESTART_TIMEOUT_S:g} s; "
                                         f"its device ({m.inst}'s) is left out")

    # --- what status shows ------------------------------------------------------------------------

    def status(self, now: float, report) -> None:
        report.rebalance = self.report(now)

    def report(self, now: float) -> RebalanceStatus | None:
        mode = self.mode
        if mode == RebalanceMode.OFF:
            return None
        serving, fixed = self.split_now(now, moving=False)
        current = dict(serving)  # as split_now(now) counts it: one pass over the instances, not two
        for m in self.moving.values():
            current[m.to_role] += 1
        p, w = self.plan, self.plan_work
        moving = [RoleMove(instance_id=m.inst, new_id=m.new_id, from_role=m.from_role, to_role=m.to_role,
                           state=m.state, age_s=round(now - m.started, 3)) for m in self.moving.values()]
        st = RebalanceStatus(
            mode=mode, budget=sum(current.values()) - sum(fixed.values()), fixed={r: n for r, n in fixed.items() if n},
            current=fmt(serving), moving=moving, moves=self.moves_done, holding=self.holding,
            last_move_s=round(now - self.last_move_end, 3) if self.last_move_end is not None else -1.0,
            window_requests=w.requests if w is not None and p is not None else 0,
            work_s={r: round(s, 6) for r, s in w.seconds.items()} if w is not None else {},
        )
        if p is not None:
            st.current_rps = round(p.current_rps, 4)
            st.recommended, st.recommended_rps = fmt(p.best), round(p.best_rps, 4)
            st.considered = [SplitRate(split=fmt(s), rps=round(r, 4)) for s, r in p.considered[:8]]
            st.current_classes, st.recommended_classes = fmt_classes(p.current_classes), fmt_classes(p.best_classes)
        return st
