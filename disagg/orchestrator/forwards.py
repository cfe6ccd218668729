"""Forwards: a stage's instance hands the next stage's Run on itself, so the request goes on without a round trip
through the orchestrator. A mixin of Router (disagg/orchestrator/router.py), beside its steps (steps.py).

When a stage is placed (`with_forwards`, from `assign`), and an instance of the next role on the same host is
free with nothing queued for that role, the orchestrator reserves it (a slot taken, as for a Run) and puts that
stage's Run inside the producer's (`Run.then`, a `Forward`; two deep when the second hop qualifies too). Only
while the stages before the reserved one are predicted, from measured stage times, to take at most
`forward.max_wait_ms`: a reserved slot waits idle that long at most. The reserved Run is placed by the same
placement chain, among the instances that qualify.

The producer, once its output is staged, reports its Staged with `forwarded` set, then sends the Forward, its slot
filled in, on the consumer's peer lane (disagg/roles/peers.py; in that order: the consumer, woken first, would take
the CPU before the Staged left, BENCHMARKS.md "Forwards"). The orchestrator then marks the request running on the
reserved instance (`forwarded`) and sends nothing. A producer that forwards nothing says so (`forwarded` false, e.g.
it registered again meanwhile), and the orchestrator places the next stage itself; a Forward that cannot be sent
on (the consumer's lane gone or full) goes to the orchestrator, which sends its Run there (`handle_forward`).

What keeps this exact under faults:
- A report of a reserved instance can overtake its producer's Staged (they travel on different sockets): it waits
  in the request (`early`) and is handled right after that Staged.
- A request that ends or goes on to another attempt while instances are reserved for it sends each a `Withdraw`,
  and keeps its slot until the instance answers with a report of that attempt: it stops it if it runs it, and
  otherwise will not run it (it remembers the attempt) and says so. Every such report frees the slot once
  (`finish_run` frees only what it holds), and is otherwise stale.
- An instance runs a Forward only for the registration it was reserved with (`orchestrator_id`, `session`): once
  it registered again (with a successor, or after it was declared dead) it drops one made before; a producer
  forwards only if it has not registered again since its Run came. What a restarted orchestrator learns back
  (Register.busy and held) is what it learns of a Run it sent itself (disagg/orchestrator/parts/recovery.py).
- A reserved instance lost (dead, or registered again) before its producer's Staged: the next stage is placed
  under a new attempt, so what the lost one may still run (declared dead, not yet told) and the withdrawn ones'
  answers are stale reports, never taken for the new placement's.
"""

from __future__ import annotations

import logging

import msgspec

from disagg.orchestrator.outbox import Out, to_instance
from disagg.orchestrator.registry import Instance
from disagg.orchestrator.requests import Request, next_stage
from disagg.orchestrator.scheduling.placement import DEFER, Placing
from disagg.settings.choices import Transfer
from disagg.transport.wire.messages import (
    Done,
    Failed,
    Fetched,
    Forward,
    Preview,
    Run,
    SlotRef,
    Source,
    Staged,
    Withdraw,
)

log = logging.getLogger("disagg.orchestrator")

#: the engines a forwarded Run's input can take: the same host's, without the orchestrator's inline frames
FORWARD_ENGINES = (Transfer.SHM, Transfer.CUDA_IPC)
#: the reports of a reserved instance that wait for its producer's Staged
RESERVED_REPORTS = (Staged, Done, Failed, Fetched, Preview)


class Forwards:
    """Methods of Router; see disagg/orchestrator/router.py for the state they use (`reservations`: (instance id,
    request id) -> attempt of every reservation not yet taken up)."""

    def with_forwards(self, req: Request, producer: Instance, run: Run, now: float) -> Run:
        """`run`, for `producer`, with the next stages' Runs inside for the instances reserved for them, where the
        module's rules allow; else `run` as it is."""
        forward = self.config.forward
        wait_s = forward.max_wait_ms / 1000
        if (not wait_s or len(self.requests) > forward.max_in_flight or req.reserved or req.params.loras
                or run.inline_output):
            return run
        then = self._reserve(req, producer, 0.0, wait_s, now)
        return run if then is None else msgspec.structs.replace(run, then=then)

    def _reserve(self, req: Request, producer: Instance, ahead: float, wait_s: float, now: float) -> Forward | None:
        role = next_stage(producer.role)
        if role is None or self.queues[role] or (role == "decoder" and req.params.previews):
            # (a request's previews are decoded on the orchestrator's word as they come: its final decode too, after them)
            return None
        took = self.deadlines.predictor.predict(producer.role, req.params)
        if took is None or ahead + took > wait_s:
            return None
        candidates = [i for i in self.registry.of_role(role)
                      if i.peer_lane and i.host == producer.host and i.dispatchable and req.id not in i.running]
        if not candidates:
            return None
        inst = self.placement.chains[role](Placing(req, role, candidates, candidates, producer.host,
                                                   producer.largest_output, now, narrowed=True))
        if inst is None or inst is DEFER:
            return None
        engine, _ = self.engine_for(producer, inst)
        if engine not in FORWARD_ENGINES:
            return None
        self.take_slot(inst, req, now)
        req.reserved.append((inst.id, inst.session))
        self.reservations[(inst.id, req.id)] = req.attempt
        # the slot is the producer's to fill in; the deadline counts from now, so the stage gets the producer's
        # time too (at most forward.max_wait_ms)
        run = self.run_for(req, role, Source(slot=SlotRef(instance_id=producer.id, offset=0, nbytes=0, tensors=[]),
                                             pool=producer.pool, engine=engine), now)
        then = self._reserve(req, inst, ahead + took, wait_s, now)
        if then is not None:
            run = msgspec.structs.replace(run, then=then)
        return Forward(instance_id=inst.id, lane=inst.peer_lane, orchestrator_id=self.id, session=inst.session, run=run)

    def park_early(self, sender: str, msg, frames: list[bytes]) -> bool:
        """A reserved instance's report that overtook its producer's Staged: kept in its request until that comes."""
        if type(msg) not in RESERVED_REPORTS or self.reservations.get((sender, msg.request_id)) != msg.attempt:
            return False
        self.requests[msg.request_id].early.append((sender, msg, list(frames)))
        return True

    def forwarded(self, req: Request, producer: Instance, msg: Staged, now: float, out: list[Out]) -> bool:
        """`req`'s stage on `producer` staged (`msg`): True if the instance reserved for the next stage runs it now
        (the producer sent it its Run); False: the reservations are withdrawn and the caller places it."""
        inst_id, session = req.reserved[0]
        inst = self.registry.by_id.get(inst_id)
        if not (msg.forwarded and inst is not None and inst.session == session and inst.state != "dead"
                and inst.running.get(req.id) == req.attempt):
            self.withdraw(req, out, sent=msg.forwarded)
            if msg.forwarded:
                # it went to an instance lost since: the next stage is placed under a new attempt, so neither what
                # that Forward may still start nor a withdrawn instance's answer is taken for the new placement's
                req.attempt += 1
                log.info("request %s: attempt %d (its Run went on to %s, lost since)", req.id, req.attempt, inst_id)
            return False
        req.reserved.pop(0)
        del self.reservations[(inst_id, req.id)]
        self.forwarded_hops += 1
        engine, _ = self.engine_for(producer, inst)
        inst.engine = engine
        self.stats.transferred(producer, inst, engine, msg.slot.nbytes)
        inst.alone = req.id if len(inst.running) == 1 else None
        self.began(req, inst, now, queued=now)
        self.replay_early(req, out, now, inst_id)
        return True

    def handle_forward(self, sender, msg: Forward, frames, now, out) -> None:
        """A producer could not send a Forward on (its instance's peer lane was gone or full): the orchestrator sends
        its Run there itself, if the request still runs there in that attempt (else it was withdrawn, and the
        instance's answer frees its slot)."""
        run = msg.run
        req = self.requests.get(run.request_id)
        inst = self.registry.by_id.get(msg.instance_id)
        if (req is not None and inst is not None and req.attempt == run.attempt and req.assigned == inst.id
                and inst.session == msg.session and inst.state != "dead"):
            out.append(to_instance(inst.id, run))

    def replay_early(self, req: Request, out: list[Out], now: float, sender: str | None = None) -> None:
        """Handle the parked reports of `sender` (None: all of them), in the order they came."""
        if not req.early:
            return
        now_, later = [], []
        for item in req.early:
            (now_ if sender is None or item[0] == sender else later).append(item)
        req.early = later
        for who, msg, frames in now_:
            self._handlers[type(msg)](who, msg, frames, now, out)

    def withdraw(self, req: Request, out: list[Out], sent: bool = True, now: float = 0.0) -> None:
        """Take back every instance reserved for `req` (it ended, or went on to another attempt). `sent`: a Forward
        may have reached them (each is told, and answers); False: its producer said it sent none, so none did and
        the slots come back at once."""
        if not req.reserved:
            return
        for inst_id, session in req.reserved:
            attempt = self.reservations.pop((inst_id, req.id), None)
            inst = self.registry.by_id.get(inst_id)
            if attempt is None or inst is None or inst.session != session or inst.state == "dead":
                continue
            if sent:
                out.append(to_instance(inst_id, Withdraw(request_id=req.id, attempt=attempt)))
            else:
                self.finish_run(inst, req.id, attempt)
        req.reserved = []
        self.replay_early(req, out, now)  # stale now: each frees its slot, and its output is released
