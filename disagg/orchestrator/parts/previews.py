"""Live previews (GenerationParams.previews): a denoiser stages a copy of a request's latents at chosen steps and
says so (Preview); the orchestrator has a decoder with a free slot decode it, under an id of its own, and sends
the image to the request's clients (Partial). The denoiser never decodes. A preview never waits: with no free
decoder, or once its request ended, its latents are released and it is skipped; one whose decode ends after a newer
one's was sent is skipped too (a client's previews come in order). A part of the Router (disagg/orchestrator/parts/base.py): it owns Preview messages and claims the
Done / Failed of its decodes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec

from disagg.orchestrator.outbox import Out, to_client, to_instance
from disagg.orchestrator.parts.base import Part
from disagg.transport.data.selection import Transfer, choose_engine
from disagg.transport.wire.messages import Done, HeldPreview, Partial, Preview, Release, Run, SlotRef, Source

log = logging.getLogger("disagg.orchestrator")

#: a preview decode not answered in this long is given up (its decoder died): its latents are released
PREVIEW_TIMEOUT_S = 60.0


@dataclass
class PreviewRun:
    request_id: str
    index: int
    step: int
    #: the denoiser whose pool holds the latents, and where
    producer: str
    offset: int
    decoder: str
    started: float
    steps: int = 0
    staged_at: float = 0.0


class Previews(Part):
    """The previews being decoded (`runs`: preview id -> PreviewRun) and the counts."""

    messages = {Preview: "handle_preview"}

    def __init__(self, core):
        self.core = core
        self.runs: dict[str, PreviewRun] = {}
        #: previews decoded and sent to clients, and skipped (no free decoder, the request gone, a failure)
        self.sent = 0
        self.skipped = 0
        #: previews staged before this orchestrator restarted that it could not send (recovery.py resend_previews)
        self.lost = 0

    def handle_preview(self, sender, msg: Preview, frames, now, out: list[Out]) -> None:
        core = self.core
        if core.recovery.keep_preview(core.registry.get(sender), msg, now):
            return  # its request resumes later (a restart): the copy is sent then
        req = core.requests.get(msg.request_id)
        ok = req is not None and req.attempt == msg.attempt and self.decode(
            req, sender, msg.slot, HeldPreview(index=msg.index, step=msg.step, steps=msg.steps, staged_at=msg.staged_at),
            frames, now, out)
        if not ok:
            self.skipped += 1
            out.append(to_instance(sender, Release(request_id=msg.request_id, offset=msg.slot.offset)))

    def decode(self, req, producer_id: str, slot: SlotRef, info: HeldPreview, frames, now, out: list[Out]) -> bool:
        """Have the decoder with the most free slots decode the preview staged at `slot` of `producer_id`'s pool;
        False (nothing sent) when the request ended or has no client, or no decoder can read it."""
        registry = self.core.registry
        producer = registry.get(producer_id)
        decoders = [d for d in registry.of_role("decoder") if d.dispatchable] \
            if producer is not None and not req.ended and req.clients else []
        engine = None
        if decoders:  # the decoder with the most free slots: a preview takes a spare one
            decoder = max(decoders, key=lambda d: d.free_slots)
            engine, _ = choose_engine(self.core.config.transfer, producer.pool, decoder.pool)
        if engine is None or (engine == Transfer.INLINE and not frames):
            return False
        pid = f"{req.id[:100]}:p{info.index}"
        params = msgspec.structs.replace(req.params_for("decoder"), previews=None)
        run = Run(request_id=pid, attempt=req.attempt, params=params,
                  source=Source(slot=slot, pool=producer.pool, engine=engine))
        decoder.free_slots -= 1
        decoder.running[pid] = req.attempt
        self.runs[pid] = PreviewRun(req.id, info.index, info.step, producer.id, slot.offset, decoder.id, now,
                                        info.steps, info.staged_at)
        out.append(to_instance(decoder.id, run, list(frames) if engine == Transfer.INLINE else []))
        return True

    def reads(self, producer_id: str, offset: int) -> bool:
        """Whether a preview decode in flight reads the copy staged at `offset` of `producer_id`'s pool."""
        return any(r.producer == producer_id and r.offset == offset for r in self.runs.values())

    def claims(self, inst, msg, frames, now: float, out: list[Out]) -> bool:
        """A Done or Failed of a preview decode: free its decoder slot and latents, send the image; False when
        `msg` is not a preview's."""
        run = self.runs.pop(msg.request_id, None)
        if run is None:
            return False
        self.core.finish_run(inst, msg.request_id, msg.attempt)
        self.release(run, out)
        req = self.core.requests.get(run.request_id)
        if not isinstance(msg, Done) or not frames or req is None or req.ended or run.index <= req.last_preview:
            self.skipped += 1  # (a newer preview was sent already: its clients never see an older one after it)
            return True
        req.last_preview = run.index
        partial = Partial(request_id=req.id, index=run.index, step=run.step, steps=run.steps, image_format=msg.image_format,
                          staged_at=run.staged_at)
        for client in req.clients:
            out.append(to_client(client, partial, frames[:1]))
        self.sent += 1
        return True

    def tick(self, now: float, out: list[Out]) -> None:
        for pid, run in [(p, r) for p, r in self.runs.items() if now - r.started > PREVIEW_TIMEOUT_S]:
            del self.runs[pid]
            self.skipped += 1
            self.release(run, out)

    def release(self, run: PreviewRun, out: list[Out]) -> None:
        """Its copy of the latents is free (one a restart found held counts in its producer's staged bytes)."""
        producer = self.core.registry.get(run.producer)
        if producer is not None:
            producer.staged.pop(run.offset, None)
        out.append(to_instance(run.producer, Release(request_id=run.request_id, offset=run.offset)))

    def status(self, now: float, report) -> None:
        #: live previews decoded and sent to clients, skipped (no free decoder, the request gone), and lost (staged
        #: before a restart, not sendable)
        report.orchestrator.update(previews_sent=self.sent, previews_skipped=self.skipped, previews_lost=self.lost)
