"""What an orchestrator learns back from its roles after it restarted, and how it resumes requests from it.

An orchestrator keeps its requests in memory only; what survives its death is spread over the others:
- every client keeps each request until its result, and sends the unanswered ones again, under the same
  ids, to the orchestrator that answers next (Submit.resume);
- every role keeps computing, keeps what it staged, and registers again listing it (Register.held: the
  outputs in its pool; Register.busy: what it still computes); a decoder also sends its Done messages of
  the last seconds again, since a result may have died with the orchestrator before reaching its client.

A restarted orchestrator first waits a moment (the recovery window) so that the roles' Registers come in
before the resubmissions are placed. Each request then resumes from the furthest stage a role holds for
it: a finished result is answered at once, a staged output goes to the next stage, running work is
waited for. What no client claims within the grace period is released: slots, pool memory, results.
Reports that reach it before their request is known again (or before their role registered) are kept
for the grace period too, never dropped. So are those of a role declared dead that is still alive (it was
stopped, or cut off): a compute that finished as it came back reports before its new Register may arrive.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

import msgspec

from disagg.orchestrator.outbox import Out, to_instance
from disagg.orchestrator.parts.base import Part
from disagg.orchestrator.requests import MONOLITH, NAMES, STAGES, Request, micro, next_stage
from disagg.transport.wire.messages import (
    Done,
    Failed,
    Fetched,
    HeldPreview,
    Preview,
    Register,
    Release,
    Result,
    SlotRef,
    Source,
    Staged,
    cache_report,
)

log = logging.getLogger("disagg.orchestrator")

#: the recovery window: at least this long after a restart...
WINDOW_MIN_S = 1.0
#: ...and until no role registered for this long...
WINDOW_QUIET_S = 0.5
#: ...but never longer than this
WINDOW_MAX_S = 5.0
#: outputs, results and reports nobody claimed are released after this long
GRACE_S = 15.0
#: bounds on what is kept unclaimed: results' bytes, early reports, and ids of ended requests
MAX_KEPT_BYTES = 256 * 2**20
MAX_EARLY = 4096
MAX_ENDED = 65_536


@dataclass
class Orphan:
    """Something a role holds (or held) for a request this orchestrator does not know (yet)."""

    request_id: str
    kind: str  # done | staged | running | preview (a copy of a denoiser's latents before its last step)
    instance_id: str
    role: str
    attempt: int
    since: float
    slot: SlotRef | None = None
    seed: int | None = None
    done: Done | None = None
    frames: list[bytes] = field(default_factory=list)
    #: a preview copy's index, step, steps and staging time
    preview: HeldPreview | None = None
    #: a denoiser's output: its step cache's label and counts, for the request's result
    cache_steps: dict = field(default_factory=dict)

    @property
    def rank(self) -> int:
        """How far the request got: running in stage i < staged by stage i < running in stage i+1 ... < done."""
        if self.kind == "done":
            return 2 * len(STAGES) + 2
        i = 0 if self.role == MONOLITH else STAGES.index(self.role)
        return 2 * i + (2 if self.kind == "staged" else 1)

    @property
    def nbytes(self) -> int:
        return sum(map(len, self.frames))


class Recovery(Part):
    """The Router's memory of what roles hold for requests it does not know, and of the window after a
    restart. `router` is the Router it serves (requests, registry, the state machine's steps)."""

    def __init__(self, router):
        self.router = router
        #: request id -> what roles hold for it
        self.orphans: dict[str, list[Orphan]] = {}
        #: instance id -> reports it sent before it registered (again): (message, frames, when, pid), where
        #: pid is that of the process declared dead that sent it (None: not registered with us yet)
        self.early: dict[str, list[tuple[object, list[bytes], float, int | None]]] = {}
        self._early_count = 0
        self.kept_bytes = 0
        #: requests this orchestrator ended: a late output of theirs is released at once
        self.ended_ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        #: Submits that came during the recovery window, in order: placed when it closes
        self.parked: list[str] = []
        self.window_from: float | None = None
        self.last_register = 0.0
        #: what the recovery resumed, for status and the tests: request id -> how
        self.resumed: dict[str, int] = collections.Counter()

    # --- the window ---------------------------------------------------------------------------

    def begin(self, now: float) -> None:
        """This orchestrator is a restart: hold new requests until the roles told what they hold."""
        self.window_from = self.last_register = now
        log.info("restarted: waiting for the roles to register again before placing resubmitted requests")

    def recovering(self, now: float) -> bool:
        if self.window_from is None:
            return False
        since = now - self.window_from
        if since < WINDOW_MIN_S or (now - self.last_register < WINDOW_QUIET_S and since < WINDOW_MAX_S):
            return True
        self.window_from = None
        return False

    def close_window(self, now: float, out: list[Out]) -> None:
        """Once the window closed: every parked request resumes (or starts) in the order it came."""
        parked, self.parked = self.parked, []
        for rid in parked:
            req = self.router.requests.get(rid)
            if req is not None and req.state == "parked":
                self.place(req, now, out)
        if parked:
            log.info("recovery: placed %d resubmitted requests (%s)", len(parked),
                     ", ".join(f"{k} {v}" for k, v in sorted(self.resumed.items())) or "none resumed")

    def place(self, req: Request, now: float, out: list[Out]) -> None:
        """A request that just became known: resume it from what roles hold, else start it."""
        if not self.claim(req, now, out):
            self.router.enqueue(req, self.router.first_stage, now)

    # --- what roles hold ----------------------------------------------------------------------

    def unknown(self, rid: str) -> bool:
        """Whether an output for `rid` is to be kept: the request is not (yet) here, or waits to resume."""
        req = self.router.requests.get(rid)
        return (req is None and rid not in self.ended_ids) or (req is not None and req.state == "parked")

    def on_register(self, inst, msg: Register, now: float, out: list[Out]) -> None:
        """An instance (re)registered: what it still computes and holds is kept for its requests' clients,
        or released at once when its request is known to have moved on."""
        self.last_register = now
        for held in msg.held:
            if self.unknown(held.request_id):
                inst.staged[held.slot.offset] = held.slot.nbytes
                if self._recorded(held.request_id, inst.id, held.slot.offset):
                    continue  # its report came first (keep_output, keep_preview): one record, one Release
                self._add(held.request_id, Orphan(held.request_id, "preview" if held.preview else "staged", inst.id,
                                                  held.role, held.attempt, now, slot=held.slot, seed=held.seed,
                                                  preview=held.preview, cache_steps=cache_report(held)))
            elif self.router.is_source(held.request_id, inst.id, held.slot.offset) or (
                    held.preview is not None and self.router.previews.reads(inst.id, held.slot.offset)):
                inst.staged[held.slot.offset] = held.slot.nbytes  # told again: still what its request reads
            else:
                out.append(to_instance(inst.id, Release(request_id=held.request_id, offset=held.slot.offset)))
        for rid, attempt in msg.busy.items():
            if self.unknown(rid):
                self._add(rid, Orphan(rid, "running", inst.id, inst.role, attempt, now))
        for msg_, frames, _, pid in self.early.pop(inst.id, []):  # what it said before it registered, in order
            self._early_count -= 1
            if pid is None or pid == msg.pid:  # not a process that died since: its pool went with it
                out.extend(self.router.handle_instance(inst.id, msg_, frames, now))

    def keep_early(self, sender: str, msg, frames: list[bytes], now: float, pid: int | None = None) -> bool:
        """A report from an instance that has not registered (yet), or from process `pid` of one declared
        dead: kept until it registers (again), then handled as if it came after. False: not kept."""
        if not isinstance(msg, (Staged, Done, Failed, Fetched)) or self._early_count >= MAX_EARLY:
            return False
        self.early.setdefault(sender, []).append((msg, list(frames), now, pid))
        self._early_count += 1
        return True

    def keep_output(self, inst, msg: Staged | Done, frames: list[bytes], now: float) -> bool:
        """An output for a request not known here: kept for the grace period. False: release it."""
        if not self.unknown(msg.request_id):
            return False
        if isinstance(msg, Done):
            size = sum(map(len, frames))
            if self.kept_bytes + size > MAX_KEPT_BYTES:
                log.warning("a result for unknown request %s dropped: %d bytes of unclaimed results kept already",
                            msg.request_id, self.kept_bytes)
                return True  # nothing to release: a Done holds no slot
            self.kept_bytes += size
            self._add(msg.request_id, Orphan(msg.request_id, "done", inst.id, inst.role, msg.attempt, now, done=msg, frames=list(frames)))
            return True
        records = self.orphans.get(msg.request_id, [])
        same = [r for r in records if r.kind == "staged" and r.instance_id == inst.id and r.slot.offset == msg.slot.offset]
        steps = cache_report(msg)
        for r in same:  # told by its Register already: the report adds its step-cache counts
            r.cache_steps = r.cache_steps or steps
        if not same:
            inst.staged[msg.slot.offset] = msg.slot.nbytes
            self._add(msg.request_id, Orphan(msg.request_id, "staged", inst.id, inst.role, msg.attempt, now, slot=msg.slot,
                                             cache_steps=steps))
        return True

    def keep_preview(self, inst, msg: Preview, now: float) -> bool:
        """A preview copy of a request not known here (yet), or parked: kept to be sent once its request resumes
        (`resend_previews`), never decoded now as well (two decodes would release its slot twice, the second
        time perhaps under the request's own output staged there since). False: its request is known."""
        if not self.unknown(msg.request_id):
            return False
        inst.staged[msg.slot.offset] = msg.slot.nbytes
        if not self._recorded(msg.request_id, inst.id, msg.slot.offset):
            self._add(msg.request_id, Orphan(msg.request_id, "preview", inst.id, inst.role, msg.attempt, now, slot=msg.slot,
                                             preview=HeldPreview(index=msg.index, step=msg.step, steps=msg.steps,
                                                                 staged_at=msg.staged_at)))
        return True

    def _recorded(self, rid: str, instance_id: str, offset: int) -> bool:
        return any(r.slot is not None and r.instance_id == instance_id and r.slot.offset == offset
                   for r in self.orphans.get(rid, ()))

    def _add(self, rid: str, orphan: Orphan) -> None:
        self.orphans.setdefault(rid, []).append(orphan)

    def forget_instance(self, instance_id: str) -> None:
        """A dead instance's pool and work went with it."""
        for rid in list(self.orphans):
            left = [r for r in self.orphans[rid] if r.kind == "done" or r.instance_id != instance_id]
            if left:
                self.orphans[rid] = left
            else:
                del self.orphans[rid]
        if self.early.pop(instance_id, None) is not None:
            self._early_count = sum(map(len, self.early.values()))

    def ended_request(self, rid: str) -> None:
        self.ended_ids[rid] = None
        if len(self.ended_ids) > MAX_ENDED:
            self.ended_ids.popitem(last=False)

    # --- resuming ------------------------------------------------------------------------------

    def claim(self, req: Request, now: float, out: list[Out]) -> bool:
        """Resume `req` from the furthest stage some role holds for it; False if none holds anything."""
        records = self.orphans.pop(req.id, None)
        if not records:
            return False  # what a new request finds: nothing held for it
        registry = self.router.registry

        def usable(r: Orphan) -> bool:
            inst = registry.get(r.instance_id)
            return r.kind == "done" or (inst is not None and inst.state != "dead")

        records = [r for r in records if usable(r)]
        previews = [r for r in records if r.kind == "preview"]  # copies of latents: never what a request resumes from
        records = [r for r in records if r.kind != "preview"]
        if not records:
            for r in previews:  # it starts again, and stages its previews again
                self.release(r, out)
            return False
        best = max(records, key=lambda r: (r.rank, r.attempt))
        # running work keeps the output it reads from, if that is still here (it may not have pulled it yet)
        source = None
        if best.kind == "running":
            inputs = [r for r in records if r.kind == "staged" and r.rank == best.rank - 1]
            source = max(inputs, key=lambda r: r.attempt) if inputs else None
        for r in records:
            if r is not best and r is not source:
                self.release(r, out)
        seed = next((r.seed for r in (best, source) if r is not None and r.seed is not None), None)
        if seed is not None and req.params.seed != seed:  # the seed the first orchestrator chose for it
            req.params = msgspec.structs.replace(req.params, seed=seed)
        req.attempt = best.attempt
        # the step cache its denoiser ran, for its result (the output it resumes from, or any report of it)
        told = [r.cache_steps for r in (best, source, *records) if r is not None and r.cache_steps]
        if told:
            req.cache_steps = dict(told[0])
        self.resumed[best.kind] += 1
        router = self.router
        self.resend_previews(req, previews, best.kind == "done", now, out)
        if best.kind == "done":
            self.kept_bytes -= best.nbytes
            done = best.done
            req.timings["total"] = micro(now - req.submitted_at)
            seed = done.resolved.get("seed", req.params.seed)
            result = Result(request_id=req.id, ok=True, image_format=done.image_format, num_images=done.num_images,
                            seed=seed if isinstance(seed, int) else req.params.seed, attempts=req.attempt,
                            timings=req.timings, resolved=done.resolved)
            log.info("request %s: its result came back from %s", req.id, best.instance_id)
            router.end(req, "done", now, out)
            router.send_result(req, result, best.frames, out)
            return True
        inst = registry.get(best.instance_id)
        if best.kind == "staged":
            req.source = Source(slot=best.slot, pool=inst.pool, engine="")
            log.info("request %s: resumed after %s from %s's output", req.id, best.role, inst.id)
            router.enqueue(req, next_stage(best.role), now, front=True)
            return True
        # running: its report comes later, to this request as if this orchestrator had sent the Run
        if source is not None:
            producer = registry.get(source.instance_id)
            req.source = Source(slot=source.slot, pool=producer.pool, engine="")
        req.stage, req.state, req.assigned = inst.role, "running", inst.id
        inst.running[req.id] = best.attempt
        req.mark(NAMES[inst.role].run, now)
        log.info("request %s: still running on %s (attempt %d)", req.id, inst.id, best.attempt)
        return True

    def resend_previews(self, req: Request, previews: list[Orphan], answered: bool, now: float, out: list[Out]) -> None:
        """Previews staged before the restart whose decode never reached the request's clients: decoded now, in
        the order they were staged; those that cannot be (the request is answered already, a copy from an
        earlier attempt, no decoder) are released and counted lost (status: previews_lost)."""
        for r in sorted(previews, key=lambda r: r.preview.index):
            if answered or r.attempt != req.attempt or not self.router.previews.decode(
                    req, r.instance_id, r.slot, r.preview, [], now, out):
                self.release(r, out)
                self.router.previews.lost += 1
                log.info("request %s: preview %d staged before the restart is lost", req.id, r.preview.index)

    def release(self, r: Orphan, out: list[Out]) -> None:
        if r.kind in ("staged", "preview"):
            inst = self.router.registry.get(r.instance_id)
            if inst is not None and inst.staged.pop(r.slot.offset, None) is not None:
                out.append(to_instance(inst.id, Release(request_id=r.request_id, offset=r.slot.offset)))
        elif r.kind == "done":
            self.kept_bytes -= r.nbytes

    def tick(self, now: float, out: list[Out]) -> None:
        if self.parked and not self.recovering(now):
            self.close_window(now, out)
        self.expire(now, out)

    def ended(self, req, state: str, now: float) -> None:
        self.ended_request(req.id)

    def expire(self, now: float, out: list[Out]) -> None:
        """Release what nobody claimed within the grace period."""
        for rid in [rid for rid, records in self.orphans.items() if min(r.since for r in records) < now - GRACE_S]:
            if self.router.requests.get(rid) is not None:
                continue  # parked: it claims them when the window closes
            records = self.orphans.pop(rid)
            for r in records:
                self.release(r, out)
            log.info("request %s: nobody claimed what %s held for it; released", rid,
                     ", ".join(sorted({r.instance_id for r in records})))
        for iid in [iid for iid, items in self.early.items() if items and items[0][2] < now - GRACE_S]:
            self._early_count -= len(self.early.pop(iid))
