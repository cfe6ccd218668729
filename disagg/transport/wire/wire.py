"""The base of every wire message (disagg/transport/wire/messages.py): a tagged msgspec struct."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

Seconds = Annotated[float, Meta(ge=0)]


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    """Base of all wire messages."""
