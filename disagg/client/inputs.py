"""Input images of a request (prompts files, HTTP bodies): a file's bytes from a path or a `data:` URL.

The bytes travel as they are, under MAX_INPUT_BYTES each; the encoder role decodes them (Pillow), so a
file that is not an image is refused there, naming the field.
"""

from __future__ import annotations

import base64
import binascii
import re
from pathlib import Path

from disagg.transport.wire.messages import MAX_INPUT_BYTES

#: the request fields that name an input image
IMAGE_FIELDS = ("image", "mask")
_DATA_URL = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,", re.I)


class InputError(ValueError):
    """An input image that cannot be read: the message names the field and the cause."""


def check_size(data: bytes, field: str) -> bytes:
    if not data:
        raise InputError(f"{field}: empty")
    if len(data) > MAX_INPUT_BYTES:
        raise InputError(f"{field}: {len(data)} bytes is over the {MAX_INPUT_BYTES}-byte limit for an input image")
    return data


def from_data_url(url: str, field: str) -> bytes:
    m = _DATA_URL.match(url)
    if not m:
        raise InputError(f"{field}: a data: URL must look like data:image/png;base64,...")
    payload = url[m.end():]
    if len(payload) > MAX_INPUT_BYTES * 4 // 3 + 4:
        raise InputError(f"{field}: over the {MAX_INPUT_BYTES}-byte limit for an input image")
    if not m.group("b64"):
        from urllib.parse import unquote_to_bytes

        return check_size(unquote_to_bytes(payload), field)
    try:
        return check_size(base64.b64decode(payload, validate=True), field)
    except (binascii.Error, ValueError) as exc:
        raise InputError(f"{field}: the data: URL is not valid base64 ({exc})") from None


def read_input(value: str, field: str, base: Path | None = None) -> bytes:
    """`value` is a data: URL, or a path (relative to `base`, the prompts file's folder)."""
    if value.startswith("data:"):
        return from_data_url(value, field)
    path = Path(value).expanduser()
    if base is not None and not path.is_absolute():
        path = base / path
    try:
        size = path.stat().st_size
        if size > MAX_INPUT_BYTES:
            raise InputError(f"{field}: {path} is {size} bytes, over the {MAX_INPUT_BYTES}-byte limit for an input image")
        return check_size(path.read_bytes(), field)
    except OSError as exc:
        raise InputError(f"{field}: cannot read {path}: {exc.strerror}") from None


def resolve_inputs(item: dict, base: Path | None = None) -> dict:
    """A request object with its image fields (paths or data: URLs) replaced by the files' bytes."""
    out = dict(item)
    for name in IMAGE_FIELDS:
        value = out.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise InputError(f"{name}: expected a path or a data: URL, got {type(value).__name__}")
        out[name] = read_input(value, name, base)
    return out
