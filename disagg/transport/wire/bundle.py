"""Bundles: several messages for one peer in one ZeroMQ message or lane packet.

Each process gathers what it sends during one turn of its loop in an `Outbox` and sends each peer
one message at the end of the turn: the message itself when there is one, else a `Bundle`
(disagg/transport/wire/messages.py) of them. `decode_frames` takes either apart on the other side.
"""

from __future__ import annotations

from typing import Union

import msgspec

from disagg.transport.wire.messages import KINDS, MAX_MESSAGE_BYTES, Bundle, ClientMessage, MessageError, decode, encode

#: each kind of message, or a Bundle of them, by the kind's id (hashing a typing.Union costs more than the lookup)
_OUTER = {id(kind): msgspec.msgpack.Decoder(Union[kind, Bundle]) for kind in KINDS}


def decode_frames(frames: list, kind=ClientMessage, max_messages: int | None = None) -> list[tuple[object, list]]:
    """Every message in one ZeroMQ message (one, or a Bundle's), each with its raw frames.

    A message that does not decode comes back as a MessageError in its place, so the good ones
    around it are still served; a malformed bundle, or one of over `max_messages`, raises MessageError."""
    data = frames[0]
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        msg = _OUTER[id(kind)].decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise MessageError(str(exc)) from None
    if not isinstance(msg, Bundle):
        return [(msg, frames[1:])]
    if max_messages is not None and len(msg.messages) > max_messages:
        raise MessageError(f"bundle of {len(msg.messages)} messages exceeds the {max_messages}-message limit")
    if len(msg.frames) != len(msg.messages) or sum(msg.frames) != len(frames) - 1:
        raise MessageError(
            f"bundle of {len(msg.messages)} messages claims {sum(msg.frames)} frames in "
            f"{len(msg.frames)} counts; {len(frames) - 1} frames came"
        )
    out, at = [], 1
    for raw, n in zip(msg.messages, msg.frames):
        try:
            item = decode(raw, kind)
        except MessageError as exc:
            item = exc
        out.append((item, frames[at : at + n]))
        at += n
    return out


def bundle_frames(items: list[tuple[bytes, list]]) -> list:
    """The frames of one ZeroMQ message carrying `items` (encoded message, its raw frames):
    the message itself when there is one, else a Bundle of them."""
    if len(items) == 1:
        payload, frames = items[0]
        return [payload, *frames]
    bundle = Bundle(messages=[msgspec.Raw(p) for p, _ in items], frames=[len(f) for _, f in items])
    out = [encode(bundle)]
    for _, frames in items:
        out.extend(frames)
    return out


#: a bundle closes at this many messages or bytes (a bigger message travels alone)
BUNDLE_MAX_MESSAGES = 1024
BUNDLE_MAX_BYTES = 56 * 1024  # fits one lane packet (disagg/transport/wire/lane.py)


class Outbox:
    """Messages waiting for the end of a loop turn, per destination, in order.

    `flush(send)` calls `send(destination, frames)` once per destination (see bundle_frames), so a
    turn that handled many messages answers each peer with one ZeroMQ message."""

    def __init__(self):
        self._pending: dict[object, list[tuple[bytes, list]]] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, destination, msg: msgspec.Struct, frames=()) -> None:
        items = self._pending.get(destination)
        if items is None:
            items = self._pending[destination] = []
        items.append((encode(msg), list(frames)))

    def flush(self, send) -> None:
        pending, self._pending = self._pending, {}
        for destination, items in pending.items():
            if len(items) == 1:  # the common case: no chunks to size
                send(destination, bundle_frames(items))
                continue
            # bounded, so one ZeroMQ message stays far below the receivers' size limits
            chunk, size = [], 0
            for item in items:
                nbytes = len(item[0]) + sum(map(len, item[1]))
                if chunk and (len(chunk) == BUNDLE_MAX_MESSAGES or size + nbytes > BUNDLE_MAX_BYTES):
                    send(destination, bundle_frames(chunk))
                    chunk, size = [], 0
                chunk.append(item)
                size += nbytes
            send(destination, bundle_frames(chunk))
