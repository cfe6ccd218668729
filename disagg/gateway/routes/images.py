"""OpenAI's images API: POST /v1/images/generations and /v1/images/edits, GET /v1/images/{id}/content."""

from __future__ import annotations

import base64
import hashlib
import re
import time
import uuid

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from disagg.gateway.errors import ApiError
from disagg.gateway.fields import cache_headers, cache_report
from disagg.gateway.images import (
    ImageEditRequest,
    parse_edit_request,
    parse_image_request,
    refusal,
    to_params,
)
from disagg.gateway.metrics import outcome_label
from disagg.gateway.state import caller_of, gateway_of, model_name
from disagg.gateway.streams import stream_images
from disagg.gateway.tenants import upstream_id

router = APIRouter()

CONTENT_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp", "mp4": "video/mp4"}
REQUEST_ID = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")


@router.post("/v1/images/generations")
async def images_generations(request: Request):
    # at most 1 MiB: disagg/gateway/limits.py refuses a longer body as it streams in, before it is all read
    req = parse_image_request(await request.body())
    return await answer_images(request, req, to_params(req))


@router.post("/v1/images/edits")
async def images_edits(request: Request):
    """OpenAI's images.edit: multipart with `image` (or `image[]`), an optional `mask`, the fields of
    generations and `strength`; the model's task follows from the inputs (edit, img2img, inpaint). The body is
    at most MAX_EDIT_BODY_BYTES, however it is sent (disagg/gateway/limits.py)."""
    req, params = await parse_edit_request(request)
    return await answer_images(request, req, params)


async def answer_images(request: Request, req, params):
    """Run one image request (generations or edits) and answer as OpenAI's images API does."""
    gw = gateway_of(request)
    if req.model:  # an adapter's name is shorthand for it at scale 1
        _, params = await gw.check_model(req.model, params)
    params = gw.key_priority(request, params)
    caller = caller_of(request)
    rid = request.headers.get("x-request-id") or uuid.uuid4().hex[:12]
    if not REQUEST_ID.match(rid):
        raise ApiError(400, "X-Request-Id: 1-128 characters of A-Z a-z 0-9 _ . : @ -", param="X-Request-Id")
    #: its id at the orchestrator: the caller's tenant's (disagg/gateway/tenants.py); the caller sees its own
    upstream = upstream_id(caller, rid)
    headers = {"X-Request-Id": rid}
    if req.stream:  # OpenAI's streaming: partial images as they come, then the completed images
        kind = "image_edit" if isinstance(req, ImageEditRequest) else "image_generation"
        params = msgspec.structs.replace(params, previews=req.partial_images or None)
        return stream_images(gw, caller, rid, upstream, params, kind, headers, req)
    asked = hashlib.sha1(msgspec.msgpack.encode(params)).hexdigest()
    answered = gw.recent.get(upstream)
    if answered is not None:  # a resubmission of a finished request: the same answer, not a second run
        if answered[0] != asked:
            raise ApiError(409, f"X-Request-Id {rid!r} was used for a request with other parameters; send new "
                                "requests under new ids", param="X-Request-Id", code="duplicate_request_id",
                           headers=headers)
        return JSONResponse(answered[1], headers=headers)
    outcome = await gw.submit_unless_gone(request, upstream, params)
    if outcome is None:  # the client hung up: cancelled unless a caller of its key still waits on it
        return Response(status_code=499, headers=headers)
    label = outcome_label(outcome)
    gw.metrics.observe(label, outcome.latency_s, outcome.timings)
    gw.activity.record(label, outcome.latency_s)
    if not outcome.ok:
        err = refusal(outcome, req)
        err.headers.update(headers)
        raise err
    fmt = outcome.image_format
    data = []
    for image in outcome.images:
        if req.response_format == "url":
            key = uuid.uuid4().hex
            gw.store.put(key, (image, CONTENT_TYPES.get(fmt, "application/octet-stream")), len(image))
            data.append({"url": f"{str(request.base_url).rstrip('/')}/v1/images/{key}/content",
                         "revised_prompt": req.prompt})
        else:
            data.append({"b64_json": base64.b64encode(image).decode(), "revised_prompt": req.prompt})
    width, height = outcome.resolved.get("width"), outcome.resolved.get("height")
    doc = {"id": rid, "created": int(time.time()), "data": data, "output_format": fmt,
           "size": f"{width}x{height}" if width and height else req.size,
           "disagg": {"request_id": rid, "seed": outcome.seed, "attempts": outcome.attempts,
                      "timings": outcome.timings, "model": model_name(outcome.resolved.get("model")),
                      **cache_report(outcome.resolved)}}
    headers.update(cache_headers(outcome.resolved))
    gw.recent.put(upstream, (asked, doc), sum(len(d.get("b64_json", "")) for d in data))
    if outcome.images:
        gw.activity.show(caller.tenant, rid, req.prompt, doc["size"], outcome.latency_s, outcome.images[0])
    return JSONResponse(doc, headers=headers)


@router.get("/v1/images/{image_id}/content")
async def image_content(image_id: str, request: Request):
    gw = gateway_of(request)
    item = gw.store.get(image_id)
    if item is None:
        raise ApiError(404, f"no image {image_id!r} (unknown, or older than {gw.settings.image_ttl:g} s)",
                       param="image_id", code="not_found")
    return Response(item[0], media_type=item[1])
