"""POST /v1/images/generations and /v1/images/edits: OpenAI's request fields (and our extensions) to GenerationParams."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from disagg.gateway.errors import ApiError, from_outcome
from disagg.gateway.fields import decode_json, extensions, field_error, parse_size, upload
from disagg.transport.wire.messages import (
    MAX_INPUT_BYTES,
    GenerationParams,
    MessageError,
    params_from_obj,
)

#: our fields, accepted at the top level of the body or inside `extra_body`
EXTENSIONS = ("negative_prompt", "num_inference_steps", "guidance_scale", "seed", "width", "height", "loras", "priority",
              "slo_ms", "cache")


class ImageRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's images.generate body. quality, style, background, moderation, output_compression and
    user are accepted and ignored (docs/guide/http.md says so); the rest is applied."""

    prompt: str
    model: str | None = None
    n: Annotated[int, Meta(ge=1, le=10)] = 1
    size: str | None = None
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: Annotated[int, Meta(ge=0, le=100)] | None = None
    user: str | None = None
    quality: str | None = None
    style: str | None = None
    background: str | None = None
    moderation: str | None = None
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    width: int | None = None
    height: int | None = None
    #: LoRA adapters: [{"name": ..., "scale": 1.0}] (registered names only)
    loras: list | None = None
    #: scheduling: higher first (default 0), and a deadline in ms from arrival (schedule / admission slo)
    priority: int | None = None
    slo_ms: float | None = None
    #: a step cache for the denoiser: {"type": "first_block", "threshold": 0.2} (disagg/roles/extensions/step_cache.py)
    cache: dict | None = None
    #: OpenAI's streaming: server-sent events, with this many partial images (live previews) before the image
    stream: bool | None = None
    partial_images: Annotated[int, Meta(ge=0, le=3)] | None = None
    extra_body: dict | None = None


class ImageEditRequest(ImageRequest, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's images.edit form (its files apart); input_fidelity is accepted and ignored."""

    strength: float | None = None
    input_fidelity: str | None = None


#: the largest images.edit body: an image and a mask at their limits, and the form's other fields
MAX_EDIT_BODY_BYTES = 2 * MAX_INPUT_BYTES + 1024 * 1024
#: the longest JSON an edits form field (loras, cache) may hold
MAX_JSON_FIELD = 64 * 1024
EDIT_EXTENSIONS = EXTENSIONS + ("strength",)


async def parse_edit_request(request) -> tuple[ImageEditRequest, GenerationParams]:
    if not request.headers.get("content-type", "").startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        raise ApiError(400, "images/edits takes multipart/form-data (the image as a file)", code="invalid_request")
    # the body is at most MAX_EDIT_BODY_BYTES however it is sent (disagg/gateway/limits.py), so are its parts on disk
    form = await request.form(max_files=4, max_fields=64, max_part_size=MAX_INPUT_BYTES + 1024)
    try:
        image = await upload(form, ("image", "image[]"), "image")
        mask = await upload(form, ("mask",), "mask")
    finally:
        await form.close()  # the uploaded parts' temporary files
    if image is None:
        raise ApiError(400, "image: required (a file, as `image` or `image[]`)", param="image", code="missing_required_parameter")
    fields = {k: v for k, v in form.multi_items() if k not in ("image", "image[]", "mask") and isinstance(v, str)}
    for name, example in (("loras", '[{"name": "A", "scale": 0.7}]'), ("cache", '{"type": "first_block"}')):
        if name in fields:  # a form field is a string: the list or object as JSON
            if len(fields[name]) > MAX_JSON_FIELD:
                raise ApiError(400, f"{name}: at most {MAX_JSON_FIELD} characters of JSON, e.g. {example}", param=name,
                               code="invalid_value")
            fields[name] = decode_json(fields[name].encode(), field=name)
    try:  # form fields are strings: convert them
        req = msgspec.convert(fields, ImageEditRequest, strict=False)
    except msgspec.ValidationError as exc:
        raise field_error(exc) from None
    return req, to_params(req, EDIT_EXTENSIONS, image=image, mask=mask)


def parse_image_request(body: bytes) -> ImageRequest:
    return decode_json(body, ImageRequest)


def to_params(req: ImageRequest, names: tuple[str, ...] = EXTENSIONS, **inputs) -> GenerationParams:
    """Validated generation parameters; a bad value is a 400 naming its field. `inputs`: image and mask bytes."""
    fields: dict = {"prompt": req.prompt, "num_images_per_prompt": req.n, "response_format": req.output_format,
                    **parse_size(req.size, "1024x1024"), **extensions(req, names),
                    **{k: v for k, v in inputs.items() if v is not None}}
    try:
        return params_from_obj(fields)
    except MessageError as exc:
        err = field_error(exc)
        if err.param in ("width", "height") and sent_size(req):
            err.param = "size"
        if err.param == "num_images_per_prompt":
            err.param = "n"
        raise err from None


def sent_size(req: ImageRequest) -> bool:
    """The client gave the size as `size` only (no width or height, at the top level or in extra_body)."""
    return bool(req.size) and req.width is None and req.height is None \
        and not (req.extra_body or {}).keys() & {"width", "height"}


def refusal(outcome, req: ImageRequest) -> ApiError:
    """The HTTP error for a request the deployment refused or could not finish (from_outcome), naming the field
    the client sent: a width or height over the model's maximum is `size` when the client sent `size`."""
    err = from_outcome(outcome)
    if err.param in ("width", "height") and sent_size(req):
        err.param, err.message = "size", f"size {req.size}: {err.message}"
    return err
