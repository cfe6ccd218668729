"""OpenAI's Videos API requests: VideoRequest and its fields to GenerationParams, jobs, progress (the routes are
disagg/gateway/routes/videos.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Annotated

import msgspec
from fastapi import Request
from msgspec import Meta

from disagg.client.inputs import InputError, check_size, from_data_url
from disagg.gateway.errors import ApiError
from disagg.gateway.fields import decode_json, extensions, field_error, input_error, parse_size
from disagg.transport.wire.messages import (
    MAX_INPUT_BYTES,
    GenerationParams,
    MessageError,
    params_from_obj,
)

#: how often clients are told to poll (the openai-poll-after-ms header)
POLL_AFTER_MS = 1000
#: jobs kept, in all: each API key holds an equal share (at least MIN_JOBS_PER_KEY) and loses only its own
MAX_JOBS, MIN_JOBS_PER_KEY = 1024, 16
#: MP4s kept for download, in all: each API key an equal share; its own oldest finished jobs go first
MAX_VIDEO_BYTES = 1024 * 1024 * 1024


def jobs_quota(tenants: int) -> int:
    """The jobs one API key (tenant) may hold when there are `tenants` keys."""
    return max(MIN_JOBS_PER_KEY, MAX_JOBS // max(1, tenants))
#: frames when only `seconds` is given: seconds x fps + 1 (Wan makes 4k+1 frames; 81 = 5 s at 16 fps)
DEFAULT_FPS = 16
#: progress while a stage runs: the encoder is quick, the denoiser's steps take most of it
ENCODER_PROGRESS, DENOISER_SPAN, DECODER_PROGRESS = 2, (5, 95), 95


class VideoRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's videos.create body (JSON or multipart form) and our extensions."""

    prompt: str
    model: str | None = None
    seconds: Annotated[float, Meta(gt=0, le=600)] | None = None
    size: str | None = None
    num_frames: int | None = None
    fps: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    negative_prompt: str | None = None
    input_reference: object | None = None
    #: LoRA adapters: [{"name": ..., "scale": 1.0}] (registered names only)
    loras: list | None = None
    #: scheduling: higher first (default 0), and a deadline in ms from arrival (schedule / admission slo)
    priority: int | None = None
    slo_ms: float | None = None
    #: a step cache for the denoiser (disagg/roles/extensions/step_cache.py)
    cache: dict | None = None
    extra_body: dict | None = None


EXTENSIONS = ("num_frames", "fps", "num_inference_steps", "guidance_scale", "seed", "negative_prompt", "loras",
              "priority", "slo_ms", "cache")


@dataclass
class VideoJob:
    id: str
    prompt: str
    model: str
    size: str
    seconds: str
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "queued"
    progress: int = 0
    completed_at: int | None = None
    error: dict | None = None
    data: bytes | None = None
    task: asyncio.Task | None = None
    #: its step cache's label and counts (disagg/gateway/fields.py cache_report), once completed
    cache: dict | None = None
    #: the API key's tenant that made it (disagg/gateway/tenants.py): only that key and admin keys see it
    tenant: str = ""

    def doc(self) -> dict:
        return {"id": self.id, "object": "video", "status": self.status, "progress": self.progress,
                "created_at": self.created_at, "completed_at": self.completed_at, "size": self.size,
                "seconds": self.seconds, "model": self.model, "prompt": self.prompt, "error": self.error,
                **({"disagg": {"cache": self.cache}} if self.cache else {})}


def reference_bytes(value) -> bytes | None:
    """input_reference: a multipart file, or a data: URL string (JSON or form); the image's bytes."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        data = bytes(value)
    elif isinstance(value, str):
        if not value.startswith("data:"):
            raise ApiError(400, "input_reference: send the image as a file, or as a data: URL (data:image/png;base64,...)",
                           param="input_reference", code="invalid_value")
        data = value
    elif isinstance(value, dict) and isinstance(value.get("image_url"), str):  # {"image_url": "data:..."}
        data = value["image_url"]
    else:
        raise ApiError(400, "input_reference: expected a file or a data: URL", param="input_reference",
                       code="invalid_value")
    try:
        return from_data_url(data, "input_reference") if isinstance(data, str) else check_size(data, "input_reference")
    except InputError as exc:
        raise input_error(exc, "input_reference") from None


def to_params(req: VideoRequest) -> GenerationParams:
    fields: dict = {"prompt": req.prompt, "response_format": "mp4", **parse_size(req.size, "832x480"),
                    **extensions(req, EXTENSIONS)}
    image = reference_bytes(req.input_reference)
    if image is not None:  # image-to-video: the encoder decodes it (an image model refuses it, naming itself)
        fields["image"] = image
    if "num_frames" not in fields and req.seconds is not None:
        fields["num_frames"] = int(req.seconds * fields.get("fps", DEFAULT_FPS)) + 1
    try:
        return params_from_obj(fields)
    except MessageError as exc:
        raise field_error(exc) from None


async def parse_video_request(request: Request) -> VideoRequest:
    # the body is at most MAX_VIDEO_BODY_BYTES however it is sent (disagg/gateway/limits.py)
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        form = await request.form(max_files=1, max_fields=64, max_part_size=MAX_INPUT_BYTES + 1024)
        try:
            data, strict = {k: v for k, v in form.items()}, False  # form fields are strings: convert them
            ref = data.get("input_reference")
            if ref is not None and not isinstance(ref, str):  # an uploaded file
                data["input_reference"] = await ref.read(MAX_INPUT_BYTES + 1)
        finally:
            await form.close()
    else:
        data, strict = decode_json(await request.body()), True
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    try:
        return msgspec.convert(data, VideoRequest, strict=strict)
    except msgspec.ValidationError as exc:
        raise field_error(exc) from None


def progress_of(state) -> tuple[str, int]:
    """(status, progress %) of a request the orchestrator still holds."""
    if state.state == "queued" and state.stage == "encoder":
        return "queued", 0
    if state.stage == "encoder":
        return "in_progress", ENCODER_PROGRESS
    if state.stage in ("denoiser", "monolith"):
        lo, hi = DENOISER_SPAN
        return "in_progress", lo + (hi - lo) * state.step // state.steps if state.steps else lo
    if state.stage == "decoder":
        return "in_progress", DECODER_PROGRESS
    return "in_progress", 0


def refuse_what_cannot_be_made(req: VideoRequest, params: GenerationParams, model: str, limits: dict) -> None:
    """A 400 at create, naming the field the user sent, for a job that would certainly fail: a video asked of an
    image model, more frames than the model makes (`seconds` as OpenAI's clients send it: 8 and 12 are over
    Wan's 81 frames at 16 fps), a size over its maximum. `limits`: the orchestrator's status (max_width,
    max_height, max_frames; absent before any instance registered)."""
    if "max_frames" not in limits:
        return
    if not limits["max_frames"]:
        raise ApiError(400, f"model {model!r} makes images, not videos: /v1/videos needs a video model (Wan)",
                       param="model", code="invalid_value")
    most = int(limits["max_frames"])
    if params.num_frames and params.num_frames > most:
        fps = params.fps or DEFAULT_FPS
        if req.num_frames is None and req.seconds is not None:
            raise ApiError(400, f"seconds {req.seconds:g} is {params.num_frames} frames at {fps} fps; {model!r} makes "
                                f"at most {most} ({(most - 1) / fps:g} s)", param="seconds", code="invalid_value")
        raise ApiError(400, f"num_frames {params.num_frames} is over this deployment's maximum of {most}",
                       param="num_frames", code="invalid_value")
    for name, value in (("width", params.width), ("height", params.height)):
        limit = int(limits.get(f"max_{name}") or 0)
        if value and limit and value > limit:
            raise ApiError(400, f"size {req.size}: {name} {value} is over this deployment's maximum of {limit}",
                           param="size", code="invalid_value")
