"""POST /v1/images/generations: OpenAI's request fields (and our extensions) to GenerationParams."""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from gateway.errors import ApiError
from transport.messages import GenerationParams, MessageError, params_from_obj

#: our fields, accepted at the top level of the body or inside `extra_body`
EXTENSIONS = ("negative_prompt", "num_inference_steps", "guidance_scale", "seed", "width", "height")


class ImageRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's images.generate body. quality, style, background, moderation, output_compression and
    user are accepted and ignored (README says so); the rest is applied."""

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
    extra_body: dict | None = None


SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
_FIELD = re.compile(r"at `\$\.([A-Za-z_]+)")


def field_error(exc: Exception) -> ApiError:
    message = str(exc)
    m = _FIELD.search(message)
    if "Object contains unknown field" in message:
        field = message.split("`")[1] if "`" in message else None
        return ApiError(400, f"unknown field {field!r}: {message}", param=field, code="unknown_parameter")
    return ApiError(400, message, param=m.group(1) if m else None, code="invalid_value")


def parse_image_request(body: bytes) -> ImageRequest:
    try:
        req = msgspec.json.decode(body, type=ImageRequest)
    except msgspec.ValidationError as exc:
        raise field_error(exc) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    return req


def parse_size(size: str | None, example: str) -> dict[str, int]:
    """{width, height} from "WxH" ({} for None or "auto"); a 400 naming `size` otherwise."""
    if size in (None, "auto"):
        return {}
    m = SIZE.match(size)
    if not m:
        raise ApiError(400, f"size {size!r}: expected WIDTHxHEIGHT, e.g. {example}", param="size", code="invalid_value")
    return {"width": int(m.group(1)), "height": int(m.group(2))}


def extensions(req, names: tuple[str, ...]) -> dict:
    """Our fields of `req`, top level or inside its `extra_body` (which wins); unknown ones are a 400."""
    extra = req.extra_body or {}
    unknown = sorted(set(extra) - set(names))
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r} in extra_body (known: {', '.join(names)})",
                       param=f"extra_body.{unknown[0]}", code="unknown_parameter")
    return {name: value for name in names if (value := extra.get(name, getattr(req, name))) is not None}


def to_params(req: ImageRequest) -> GenerationParams:
    """Validated generation parameters; a bad value is a 400 naming its field."""
    fields: dict = {"prompt": req.prompt, "num_images_per_prompt": req.n, "response_format": req.output_format,
                    **parse_size(req.size, "1024x1024"), **extensions(req, EXTENSIONS)}
    try:
        return params_from_obj(fields)
    except MessageError as exc:
        err = field_error(exc)
        if err.param in ("width", "height") and req.size and req.width is None and req.height is None \
                and not (req.extra_body or {}).keys() & {"width", "height"}:
            err.param = "size"
        if err.param == "num_images_per_prompt":
            err.param = "n"
        raise err from None
