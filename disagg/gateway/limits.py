"""Limits that hold however a request arrives: each route's body size, counted as the body streams in (with a
Content-Length or chunked alike), a budget of body bytes for all requests together, and read timeouts for the
headers (SlowHeaders, uvicorn's protocol) and the body (BodyLimits, a plain ASGI middleware)."""

from __future__ import annotations

import asyncio
import logging

from disagg.gateway.errors import ApiError
from disagg.gateway.images import MAX_EDIT_BODY_BYTES

log = logging.getLogger("disagg.gateway")

MIB = 1024 * 1024
#: the largest JSON body of /v1/images/generations (a prompt is at most 20,000 characters)
MAX_BODY_BYTES = MIB
#: /v1/videos: an input_reference of 16 MiB (as a data: URL in JSON, 4/3 of it) and the other fields
MAX_VIDEO_BODY_BYTES = MAX_EDIT_BODY_BYTES
#: any other route: it reads no body
MAX_OTHER_BODY_BYTES = 64 * 1024
#: (method, path) -> the most bytes its body may have
LIMITS = {("POST", "/v1/images/generations"): MAX_BODY_BYTES, ("POST", "/v1/images/edits"): MAX_EDIT_BODY_BYTES,
          ("POST", "/v1/videos"): MAX_VIDEO_BODY_BYTES}


def body_limit(scope) -> int:
    return LIMITS.get((scope["method"], scope["path"].rstrip("/") or "/"), MAX_OTHER_BODY_BYTES)


def too_large(limit: int, size: int | None = None) -> ApiError:
    said = f"a body of {size} bytes" if size is not None else "the body"
    return ApiError(413, f"{said} is over this route's {limit}-byte limit", code="too_large",
                    headers={"x-should-retry": "false"})


class BodyLimits:
    """Plain ASGI (it must see `receive` itself): a body over its route's limit is refused with 413 as soon as its
    Content-Length says so (before it is read) or as soon as the bytes received pass it (chunked), so no route
    ever buffers or spools more; the bytes being held by every request together stay within `budget` (503
    past it); a body that goes silent for `read_timeout` or is not in after `body_timeout` gets 408."""

    def __init__(self, inner, budget: int, read_timeout: float, body_timeout: float):
        self.inner, self.budget = inner, budget
        self.read_timeout, self.body_timeout = read_timeout, body_timeout
        #: body bytes received by the requests in progress
        self.held = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.inner(scope, receive, send)
        limit = body_limit(scope)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            return await too_large(limit, int(length)).response()(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        got = {"bytes": 0, "done": False, "started": False}

        async def limited_receive():
            if got["done"]:  # the body is in: what follows is the client's disconnect, whenever it comes
                return await receive()
            try:
                async with asyncio.timeout(max(0.0, min(self.read_timeout, deadline - loop.time()))):
                    message = await receive()
            except TimeoutError:
                raise ApiError(408, f"the body did not arrive in time (silent for {self.read_timeout:g} s, or not "
                                    f"all in after {self.body_timeout:g} s)", code="timeout",
                               headers={"Connection": "close"}) from None
            if message["type"] != "http.request":
                return message
            n = len(message.get("body", b""))
            got["bytes"] += n
            self.held += n
            got["done"] = not message.get("more_body", False)
            if got["bytes"] > limit:
                raise too_large(limit)
            if self.held > self.budget:
                raise ApiError(503, "the gateway holds too many request bodies at once; send it again shortly",
                               code="busy", headers={"Retry-After": "1"})
            return message

        async def watched_send(message):
            if message["type"] == "http.response.start":
                got["started"] = True
            await send(message)

        try:
            await self.inner(scope, limited_receive, watched_send)
        except ApiError as exc:  # raised from `receive` outside a route's own error handling
            if got["started"]:
                raise
            await exc.response()(scope, receive, send)
        finally:
            self.held -= got["bytes"]


#: the most bytes of a request line and headers (httptools has no limit of its own: a header without end would
#: grow until the header timeout)
MAX_HEADER_BYTES = 64 * 1024
#: the most bytes of a body refused before it was all in (413) that are read and dropped, so that the client can
#: read its 413 (a client sends its whole body before it reads), before its connection is closed
MAX_DRAINED_BYTES = 256 * MIB


def slow_headers_protocol(timeout_s: float):
    """uvicorn's httptools protocol, closing a connection whose request headers are not all in `timeout_s` after
    it opened or after the request's first byte (408, then closed), or are over MAX_HEADER_BYTES (431). uvicorn
    has neither of its own: a client sending a header a minute would hold its connection forever. Also: the rest
    of a body answered before it was all in is dropped as uvicorn does, up to MAX_DRAINED_BYTES; then the
    connection is closed."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    def refusal(status: str, text: bytes) -> bytes:
        return (f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {len(text)}\r\n"
                "connection: close\r\n\r\n").encode() + text

    late = refusal("408 Request Timeout", b"the request headers did not arrive in time\n")
    too_long = refusal("431 Request Header Fields Too Large", b"the request line and headers are over 64 KiB\n")

    class SlowHeaders(HttpToolsProtocol):
        _headers_timer = None
        #: bytes of the request line and headers so far, and the last 3 bytes seen (the end may straddle reads)
        _header_bytes, _tail = 0, b""

        def _arm(self):
            self._disarm()
            self._header_bytes, self._tail = 0, b""
            self._headers_timer = self.loop.call_later(timeout_s, self._headers_late)

        def data_received(self, data):
            if self._headers_timer is not None:  # reading a request's headers: count them up to their end
                seen = self._tail + data
                end = seen.find(b"\r\n\r\n")
                self._header_bytes += (len(data) if end < 0 else end + 4 - len(self._tail))
                self._tail = seen[-3:]
                if self._header_bytes > MAX_HEADER_BYTES:
                    self._disarm()
                    self._refuse(too_long)
                    return
            super().data_received(data)

        def _refuse(self, response: bytes):
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(response)
                self.transport.close()

        def _disarm(self):
            if self._headers_timer is not None:
                self._headers_timer.cancel()
                self._headers_timer = None

        def _headers_late(self):
            self._headers_timer = None
            self._refuse(late)

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self):
            super().on_message_begin()
            self._drained = 0
            if self._headers_timer is None:  # a request after the first (that one's count runs since connecting)
                self._arm()

        def on_body(self, body):
            if self.cycle is not None and self.cycle.response_complete:  # answered already: dropped
                self._drained = getattr(self, "_drained", 0) + len(body)
                if self._drained > MAX_DRAINED_BYTES and not self.transport.is_closing():
                    self.transport.close()
                return
            super().on_body(body)

        def on_headers_complete(self):
            self._disarm()
            super().on_headers_complete()  # (an idle keep-alive connection: uvicorn's timeout_keep_alive closes it)

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

    return SlowHeaders
