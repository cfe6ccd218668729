"""The security review's input attacks (notes of 2026-12-04: F6, F7, F10-F12) against one real deployment
(tests/security_deployment.py): bodies over a route's limit are refused with 413 while they stream in, with the
gateway's memory and temporary files bounded; too deep JSON is a 400 naming the field; no server path in errors;
slow clients time out. Each attack is bounded in count and time and its outcome asserted."""

from __future__ import annotations

import io
import os
import socket
import threading
import time

import httpx
import psutil
import pytest
from PIL import Image

from tests.security_deployment import (  # noqa: F401 - its fixtures, used by name
    ALICE,
    BOB,
    BODY_TIMEOUT_S,
    MAIN,
    MB,
    OPS,
    READ_TIMEOUT_S,
    auth,
    counts,
    dep,
    gateway_process,
    generate,
    http,
    video_app,
)

pytestmark = pytest.mark.e2e


# --- F6, F7: body limits --------------------------------------------------------------------------------------


def chunks(total: int, head: bytes = b"", tail: bytes = b"", size: int = 1 << 20):
    yield head
    for sent in range(0, total, size):
        yield b"a" * min(size, total - sent)
    yield tail


class Peak:
    """The gateway's peak RSS and the peak bytes of the regular files it holds open (spooled uploads), sampled."""

    def __init__(self, proc: psutil.Process):
        self.proc = proc
        self.rss0, self.files0 = proc.memory_info().rss, self._open_bytes()
        self.rss, self.files, self._stop = self.rss0, self.files0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open_bytes(self) -> int:
        total = 0
        for fd in os.listdir(f"/proc/{self.proc.pid}/fd"):
            try:
                st = os.stat(f"/proc/{self.proc.pid}/fd/{fd}")
            except OSError:
                continue
            if (st.st_mode & 0o170000) == 0o100000:
                total += st.st_size
        return total

    def _run(self):
        while not self._stop.is_set():
            self.rss = max(self.rss, self.proc.memory_info().rss)
            self.files = max(self.files, self._open_bytes())
            time.sleep(0.005)

    def stop(self):
        self._stop.set()
        self.thread.join()


def test_oversized_bodies_are_refused_with_413_and_the_gateway_stays_small(dep, http):
    """F6, F7: at once, a 100 MB JSON body with its Content-Length, the same chunked, a 100 MB chunked multipart edit
    (the file part) and a 100 MB chunked urlencoded edit: each is refused (413; the urlencoded one at its 16 MiB
    field limit, 400) while the gateway's memory grows by under 100 MB and it spools at most one edit's limit to
    disk per request."""
    from disagg.gateway.limits import MAX_EDIT_BODY_BYTES

    proc = gateway_process(dep)
    peak = Peak(proc)
    boundary = "b0undary"
    part = (f'--{boundary}\r\ncontent-disposition: form-data; name="prompt"\r\n\r\nx\r\n--{boundary}\r\n'
            f'content-disposition: form-data; name="image"; filename="a.png"\r\ncontent-type: image/png\r\n\r\n').encode()
    sends = {
        "json": dict(url="/v1/images/generations", content=b'{"prompt": "' + b"a" * MB + b'"}',
                     headers=auth(ALICE, **{"content-type": "application/json"})),
        "json chunked": dict(url="/v1/images/generations", content=chunks(MB, b'{"prompt": "', b'"}'),
                             headers=auth(ALICE, **{"content-type": "application/json"})),
        "edit chunked": dict(url="/v1/images/edits", content=chunks(MB, part, f"\r\n--{boundary}--\r\n".encode()),
                             headers=auth(BOB, **{"content-type": f"multipart/form-data; boundary={boundary}"})),
        "form chunked": dict(url="/v1/images/edits", content=chunks(MB, b"prompt=x&image="),
                             headers=auth(BOB, **{"content-type": "application/x-www-form-urlencoded"})),
    }
    got = {}

    def send(name):
        t0 = time.monotonic()
        r = httpx.post(dep.http + sends[name].pop("url"), timeout=60, **sends[name])
        got[name] = (r.status_code, r.json()["error"], time.monotonic() - t0)

    threads = [threading.Thread(target=send, args=(name,)) for name in sends]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    peak.stop()
    growth = (peak.rss - peak.rss0) / 2**20
    print(f"\n100 MB bodies: {', '.join(f'{k}: {v[0]} in {v[2]:.2f} s' for k, v in got.items())}; gateway RSS "
          f"{peak.rss0 / 2**20:.0f} MiB, peak +{growth:.0f} MiB; open files peak +{(peak.files - peak.files0) / 2**20:.1f} MiB")
    assert {k: v[0] for k, v in got.items()} == {"json": 413, "json chunked": 413, "edit chunked": 413,
                                                 "form chunked": 400}, got
    assert all(v[1]["code"] == "too_large" for k, v in got.items() if k != "form chunked")
    assert growth < 100
    assert peak.files - peak.files0 <= MAX_EDIT_BODY_BYTES
    assert generate(http, ALICE, "still here").status_code == 200


def test_the_413_comes_while_the_body_streams_in(dep):
    """F6, F7: a client that reads while it sends sees the 413 before it has sent much more than the limit (a
    chunked 100 MB body to generations, 1 MiB limit; and to edits, 33 MiB), whatever the framing; one that gives a
    Content-Length over the limit gets it before sending any body. (The margin: what the sockets' buffers hold.)"""
    host, port = dep.http.removeprefix("http://").split(":")
    part = (b'--b0undary\r\ncontent-disposition: form-data; name="image"; filename="a.png"\r\n'
            b"content-type: image/png\r\n\r\n")
    heads = {
        "/v1/images/generations": (b"content-type: application/json\r\n", b'{"prompt": "'),
        "/v1/images/edits": (b"content-type: multipart/form-data; boundary=b0undary\r\n", part),
    }
    seen = {}
    for path, (head, first) in heads.items():
        with socket.create_connection((host, int(port))) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {ALICE}\r\n".encode() + head +
                      b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(first), first))
            s.setblocking(False)
            piece = b"%x\r\n%s\r\n" % (65536, b"a" * 65536)
            sent, t0, answer = 0, time.monotonic(), b""
            while sent < MB and time.monotonic() - t0 < 30:
                try:
                    answer += s.recv(4096)
                except BlockingIOError:
                    pass
                if answer:
                    break
                try:
                    n = s.send(piece[sent % len(piece):])  # a partial send: the rest of the piece next
                    sent += n
                except BlockingIOError:
                    time.sleep(0.001)
                except ConnectionError:  # closed: what it answered is still to be read
                    s.setblocking(True)
                    s.settimeout(5)
                    answer += s.recv(4096)
                    break
            seen[path] = (answer.split(b"\r\n")[0], sent, time.monotonic() - t0, answer[-300:])
        with socket.create_connection((host, int(port))) as s:  # a Content-Length over the limit, no body
            s.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {ALICE}\r\n".encode() + head +
                      b"content-length: 104857600\r\n\r\n")
            s.settimeout(10)
            assert s.recv(4096).startswith(b"HTTP/1.1 413 ")
    print("\n413 while streaming: " + ", ".join(f"{p}: after {sent / 2**20:.1f} MiB, {dt:.2f} s"
                                                for p, (_, sent, dt, _) in seen.items()))
    gen, edit = seen["/v1/images/generations"], seen["/v1/images/edits"]
    assert gen[0].startswith(b"HTTP/1.1 413 ") and gen[1] < 24 * 2**20, gen
    assert edit[0].startswith(b"HTTP/1.1 413 ") and edit[1] < 60 * 2**20, edit


def test_a_body_without_the_key_is_refused_before_it_is_read(dep):
    r = httpx.post(dep.http + "/v1/images/generations", content=chunks(8 * 2**20), timeout=30)
    assert r.status_code == 401


def test_the_bodies_held_at_once_stay_within_the_budget():
    """F6/F7 under concurrency: bodies being received count against http.body_budget_mib together (503 past it)."""
    import asyncio

    from disagg.gateway.limits import BodyLimits

    async def app(scope, receive, send):  # reads its whole body, then answers
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def request(limits, pieces, gate):
        async def receive():
            if not pieces:
                return {"type": "http.disconnect"}
            piece = pieces.pop(0)
            if not pieces:
                await gate.wait()  # every request holds its body until all are in
            return {"type": "http.request", "body": piece, "more_body": bool(pieces)}

        status = []

        async def send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])

        await limits(scope, receive, send)
        return status[0]

    scope = {"type": "http", "method": "POST", "path": "/v1/images/edits", "headers": []}

    async def main():
        limits = BodyLimits(app, budget=10 * 2**20, read_timeout=5, body_timeout=5)
        gate = asyncio.Event()
        tasks = [asyncio.ensure_future(request(limits, [b"x" * 2**20] * 4, gate)) for _ in range(4)]
        await asyncio.sleep(0.1)
        gate.set()
        codes = sorted(await asyncio.gather(*tasks))
        return codes, limits.held

    codes, held = asyncio.run(main())
    # three hold 3 MiB each; the fourth's second MiB passes 10 MiB: 503 (its bytes freed), then the three finish
    assert codes == [200, 200, 200, 503] and held == 0, codes


# --- F10, F11: nesting and server paths ----------------------------------------------------------------------


def test_too_deep_json_is_a_400_naming_the_field(dep, http):
    """F10: 500,000 `[` in loras, 80,000 `{"a":` in extra_body.cache (past the interpreter's recursion), 40 levels of
    cache (past the gateway's 32), a form field of an edit and a video's JSON body: each a 400 naming the field."""
    deep = {
        "loras": b'{"prompt": "x", "loras": ' + b"[" * 500_000 + b"]" * 500_000 + b"}",
        "extra_body.cache": b'{"prompt": "x", "extra_body": {"cache": ' + b'{"a":' * 80_000 + b"1" + b"}" * 80_000 + b"}}",
        "cache": b'{"prompt": "x", "cache": ' + b'{"a":' * 40 + b"1" + b"}" * 40 + b"}",
    }
    for field, body in deep.items():
        r = http.post("/v1/images/generations", content=body, headers=auth(ALICE, **{"content-type": "application/json"}))
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text[:300])
        assert "nested deeper than 32" in r.json()["error"]["message"]
    png = io.BytesIO()
    Image.new("RGB", (64, 64)).save(png, format="PNG")
    r = http.post("/v1/images/edits", headers=auth(ALICE), files={"image": ("a.png", png.getvalue(), "image/png")},
                  data={"prompt": "x", "loras": "[" * 20_000 + "]" * 20_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "loras", r.text[:300]
    r = http.post("/v1/videos", headers=auth(ALICE, **{"content-type": "application/json"}),
                  content=b'{"prompt": "x", "extra_body": {"loras": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "extra_body.loras", r.text[:300]
    assert generate(http, ALICE, "still here").status_code == 200


def test_no_server_paths_in_errors_or_model_info(video_app, monkeypatch):
    """F11: a folder checkpoint is named by its folder, in /v1/model_info, in a 404 for another model and in a video
    job; the deployment's error texts (a LoRA file that cannot be read, made in the roles) lose their paths."""
    from disagg.client import Outcome
    from disagg.gateway.errors import from_outcome
    from disagg.gateway.state import Gateway
    from disagg.transport.wire.codes import ErrorCode
    from disagg.transport.wire.messages import GenerationParams

    async def served(self):
        return "/srv/models/FLUX.1-dev/"

    monkeypatch.setattr(Gateway, "served_model", served)
    c = video_app
    assert c.get("/v1/model_info", headers=auth(BOB)).json()["model_path"] == "FLUX.1-dev"
    wrong = c.post("/v1/images/generations", json={"prompt": "x", "model": "other"}, headers=auth(BOB))
    assert wrong.status_code == 404 and "/srv" not in wrong.text and "FLUX.1-dev" in wrong.text
    assert "/srv" not in c.get("/v1/models/other", headers=auth(BOB)).text
    job = c.post("/v1/videos", json={"prompt": "p", "size": "64x64", "num_inference_steps": 1}, headers=auth(BOB))
    assert job.json()["model"] == "FLUX.1-dev"
    text = ("denoiser denoiser-0 failed: LoraError: adapter 'passwd' cannot be read from /home/op/loras/passwd."
            "safetensors: OSError: [Errno 2] No such file or directory: '/home/op/loras/passwd.safetensors'")
    err = from_outcome(Outcome("r", GenerationParams(prompt="p"), False, text, code=ErrorCode.INVALID_INPUT))
    assert "/home" not in err.message and "passwd.safetensors" in err.message, err.message


# --- F12: slow clients ---------------------------------------------------------------------------------------


def test_slow_clients_hit_the_header_and_body_timeouts(dep, http):
    """F12: connections that send nothing, half their headers, half their body, or a body a byte at a time are
    answered 408 and closed after http.read_timeout (silence) or http.body_timeout (the whole body); meanwhile
    others are served."""
    host, port = dep.http.removeprefix("http://").split(":")
    head = (f"POST /v1/images/generations HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {ALICE}\r\n"
            "content-type: application/json\r\ncontent-length: 1000\r\n\r\n").encode()
    openings = {"nothing": b"", "half the headers": head[:60], "half the body": head + b'{"prompt": "',
                "a byte at a time": head}
    ended = {}

    def client(name, n):
        with socket.create_connection((host, int(port))) as s:
            t0 = time.monotonic()
            s.sendall(openings[name])
            s.settimeout(0.3)
            answer = b""
            while time.monotonic() - t0 < BODY_TIMEOUT_S + 5:
                try:
                    got = s.recv(4096)
                    if not got:
                        break
                    answer += got
                except socket.timeout:
                    if name == "a byte at a time":
                        try:
                            s.sendall(b" ")
                        except OSError:
                            break
                except OSError:
                    break
            ended[(name, n)] = (answer.split(b"\r\n")[0], time.monotonic() - t0)

    threads = [threading.Thread(target=client, args=(name, n)) for name in openings for n in range(5)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    assert generate(http, BOB, "served meanwhile").status_code == 200
    served_s = time.monotonic() - t0
    for t in threads:
        t.join(BODY_TIMEOUT_S + 10)
    print("\nslow clients: " + ", ".join(f"{name}: {first.decode()} after {dt:.1f} s"
                                         for (name, n), (first, dt) in sorted(ended.items()) if n == 0) +
          f"; a request meanwhile {served_s * 1000:.0f} ms")
    for (name, _), (first, dt) in ended.items():
        assert first.startswith(b"HTTP/1.1 408 "), (name, first)
        limit = BODY_TIMEOUT_S if name == "a byte at a time" else READ_TIMEOUT_S
        assert limit - 0.2 < dt < limit + 2.5, (name, dt)


def test_headers_without_end_are_refused_at_64_kib(dep, http):
    """F12: httptools keeps a header until its end: one of 8 MiB sent at once is refused (431) after 64 KiB."""
    host, port = dep.http.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.settimeout(10)
        s.sendall(b"GET /liveness HTTP/1.1\r\nhost: x\r\nx-a: ")
        answer, sent = b"", 0
        try:
            while sent < 8 * 2**20:
                sent += s.send(b"a" * 65536)
        except ConnectionError:
            pass
        try:
            answer = s.recv(4096)
        except ConnectionError:
            pass
    first = answer.split(b"\r\n")[0].decode()
    print(f"\nan endless header: {first} after {sent / 2**20:.2f} MiB sent")
    assert answer.startswith(b"HTTP/1.1 431 ") and sent < 8 * 2**20, (answer[:100], sent)
    assert http.get("/liveness").status_code == 200


def test_a_result_names_a_folder_checkpoint_by_its_folder():
    """Issue 43 F11: the model a result reports (and a PNG's text chunks carry) is a folder's name, not its path."""
    from disagg.roles.stage import resolved

    assert resolved({"seed": 1}, "/srv/models/FLUX.1-dev/")["model"] == "FLUX.1-dev"
    assert resolved({"seed": 1}, "black-forest-labs/FLUX.1-dev")["model"] == "black-forest-labs/FLUX.1-dev"
