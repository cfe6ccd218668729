"""OpenAI's image streaming (`stream: true`, `partial_images` 0-3): server-sent events
`image_generation.partial_image` (or `image_edit.partial_image`) as the request's live previews arrive, then one
`image_generation.completed` per image, or an `error` event. A client that hangs up mid-stream cancels the
request, unless another caller of its API key waits on it. Also `GET /v1/videos/{id}/events`' progress events
(disagg/gateway/routes/videos.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import time

from fastapi.responses import StreamingResponse

from disagg.gateway.fields import cache_report
from disagg.gateway.images import refusal
from disagg.gateway.metrics import outcome_label


def sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def image_event(kind: str, what: str, image: bytes, fmt: str, size: str, **extra) -> bytes:
    """One of OpenAI's ImageGen/ImageEdit stream events (its fields: quality and background as "auto")."""
    return sse(f"{kind}.{what}", {"type": f"{kind}.{what}", "b64_json": base64.b64encode(image).decode(),
                                  "created_at": int(time.time()), "size": size, "quality": "auto",
                                  "background": "auto", "output_format": fmt, **extra})


def stream_images(gw, caller, rid: str, upstream: str, params, kind: str, headers: dict, req) -> StreamingResponse:
    """The request run with its previews streamed; `kind`: image_generation or image_edit. `rid`: the caller's
    X-Request-Id, `upstream`: its id at the orchestrator (disagg/gateway/tenants.py); `req`: the request as sent."""
    queue: asyncio.Queue = asyncio.Queue()
    size = f"{params.width}x{params.height}"

    async def events():
        task = asyncio.ensure_future(gw.client.submit(upstream, params,
                                                      on_partial=lambda p, data: queue.put_nowait((p, data))))
        gw.waiting[upstream] += 1
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    break
                partial, data = getter.result()
                yield image_event(kind, "partial_image", data, partial.image_format, size,
                                  partial_image_index=partial.index)
            while not queue.empty():  # previews that came with the result
                partial, data = queue.get_nowait()
                yield image_event(kind, "partial_image", data, partial.image_format, size,
                                  partial_image_index=partial.index)
            outcome = task.result()
            label = outcome_label(outcome)
            gw.metrics.observe(label, outcome.latency_s, outcome.timings)
            gw.activity.record(label, outcome.latency_s)
            if not outcome.ok:
                err = refusal(outcome, req)
                yield sse("error", {"type": "error", "error": {"message": err.message, "code": err.code,
                                                                "param": err.param, "type": "invalid_request_error"}})
                return
            width, height = outcome.resolved.get("width"), outcome.resolved.get("height")
            final = f"{width}x{height}" if width and height else size
            usage = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                     "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}}
            for image in outcome.images:
                yield image_event(kind, "completed", image, outcome.image_format, final, usage=usage,
                                  disagg={"request_id": rid, "seed": outcome.seed, "timings": outcome.timings,
                                          **cache_report(outcome.resolved)})
            if outcome.images:
                gw.activity.show(caller.tenant, rid, params.prompt, final, outcome.latency_s, outcome.images[0])
        finally:
            # the client hung up before the end: unless a caller of its key still waits on it, the deployment stops
            # the work
            asyncio.ensure_future(gw.leave(upstream, task))

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={**headers, "Cache-Control": "no-cache"})
