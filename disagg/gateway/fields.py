"""Field helpers every route shares: request validation errors, sizes, our extension fields, uploads."""

from __future__ import annotations

import re

import msgspec

from disagg.client.inputs import InputError, check_size, from_data_url
from disagg.gateway.errors import ApiError
from disagg.transport.wire.messages import MAX_INPUT_BYTES


def input_error(exc: InputError, field: str) -> ApiError:
    """An unreadable input image as HTTP: 413 over the size limit, else 400, naming the field."""
    too_big = "limit" in str(exc)
    return ApiError(413 if too_big else 400, str(exc), param=field, code="too_large" if too_big else "invalid_value")


async def upload(form, names: tuple[str, ...], field: str) -> bytes | None:
    """The bytes of the one file (or data: URL field) sent under any of `names` (None if none was)."""
    files = [f for name in names for f in form.getlist(name)]
    if not files:
        return None
    if len(files) > 1:
        raise ApiError(400, f"{field}: one image is taken, {len(files)} were sent", param=field, code="invalid_value")
    item = files[0]
    try:
        if isinstance(item, str):
            return from_data_url(item, field) if item.startswith("data:") else check_size(item.encode(), field)
        return check_size(await item.read(MAX_INPUT_BYTES + 1), field)
    except InputError as exc:
        raise input_error(exc, field) from None


SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
_FIELD = re.compile(r"at `\$\.([A-Za-z_]+)")


def field_error(exc: Exception) -> ApiError:
    message = str(exc)
    m = _FIELD.search(message)
    if "Object contains unknown field" in message:
        field = message.split("`")[1] if "`" in message else None
        return ApiError(400, f"unknown field {field!r}: {message}", param=field, code="unknown_parameter")
    return ApiError(400, message, param=m.group(1) if m else None, code="invalid_value")


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


#: what a Result's resolved parameters say of the denoiser's step cache (disagg/roles/extensions/step_cache.py)
CACHE_KEYS = ("cache", "steps_computed", "steps_skipped")


def cache_report(resolved: dict) -> dict:
    """The step cache's label and counts, for the `disagg` field of a response (empty without a cache)."""
    return {"cache": {k: resolved[k] for k in CACHE_KEYS if k in resolved}} if "steps_computed" in resolved else {}


def cache_headers(resolved: dict) -> dict[str, str]:
    """X-Disagg-Steps-Computed / -Skipped: the same counts where a client reads headers only."""
    if "steps_computed" not in resolved:
        return {}
    return {"X-Disagg-Steps-Computed": str(resolved["steps_computed"]),
            "X-Disagg-Steps-Skipped": str(resolved.get("steps_skipped", 0))}


#: the deepest a JSON value of a request may nest (the deepest the API needs is 4: {extra_body: {loras: [{...}]}})
MAX_DEPTH = 32
#: a JSON body's tokens that open or close a value, keys' colons, and its strings (skipped whole)
_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}:]', re.S)


def too_deep(text: bytes, limit: int = MAX_DEPTH) -> str | None:
    """Where a JSON text nests deeper than `limit`: the field, as the keys leading there (the first two of them,
    "extra_body.cache"; "" for the top level); None if it does not."""
    stack: list[list] = []  # per open value: [its bracket, the key being read in it]
    last = b""
    for m in _TOKENS.finditer(text):
        tok = m.group()
        if tok[:1] == b'"':
            last = tok
        elif tok == b":":
            if stack:
                stack[-1][1] = last[1:-1].decode("utf-8", "replace")
        elif tok in (b"{", b"["):
            stack.append([tok, None])
            if len(stack) > limit:
                keys = [k for bracket, k in stack[:-1] if bracket == b"{" and k is not None]
                return ".".join(keys[:2] if keys[:1] == ["extra_body"] else keys[:1])
        elif stack:
            stack.pop()
    return None


def deepest(value, limit: int = MAX_DEPTH, path: str = "") -> str | None:
    """Like too_deep, for a decoded value (dicts and lists): the field where it nests deeper than `limit`."""
    todo = [(value, 1, path)]
    while todo:
        item, depth, where = todo.pop()
        if isinstance(item, dict):
            children = [(v, k if not where else f"{where}.{k}" if where == "extra_body" else where)
                        for k, v in item.items()]
        elif isinstance(item, list):
            children = [(v, where) for v in item]
        else:
            continue
        if depth > limit:
            return where
        todo += [(v, depth + 1, w) for v, w in children if isinstance(v, (dict, list))]
    return None


def nested_too_deep(field: str) -> ApiError:
    return ApiError(400, f"{field or 'the body'}: nested deeper than {MAX_DEPTH} levels", param=field or None,
                    code="invalid_value")


def decode_json(body: bytes, type=object, field: str = ""):
    """A JSON text decoded as `type`; a 400 for bad JSON, a wrong field (naming it) or nesting deeper than
    MAX_DEPTH (naming the field). `field`: the form field the text came in ("" for a whole body), which counts as
    one level, as a field of a JSON body does."""
    try:
        value = msgspec.json.decode(body, type=type)
    except RecursionError:  # deeper than the interpreter goes: find the field in the text
        raise nested_too_deep(field or too_deep(body) or "") from None
    except msgspec.ValidationError as exc:
        raise field_error(exc) from None
    except msgspec.DecodeError as exc:
        what = f"{field}: not valid JSON" if field else "the body is not valid JSON"
        raise ApiError(400, f"{what}: {exc}", param=field or None, code="invalid_json") from None
    where = deepest({field: value} if field else msgspec.structs.asdict(value) if isinstance(value, msgspec.Struct)
                    else value)
    if where is not None:
        raise nested_too_deep(where)
    return value
