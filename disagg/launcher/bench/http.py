"""`disagg bench --http URL`: the same load shapes as `disagg bench`, through the HTTP gateway, so the
two paths compare in one run. A client with Client's run_all / status, for run_load."""

from __future__ import annotations

import asyncio
import base64
import time

import msgspec

from disagg.client import Outcome, Unreachable, new_request_id
from disagg.transport.wire.messages import GenerationParams, StatusReport


def image_body(p: GenerationParams) -> dict:
    body: dict = {"prompt": p.prompt, "n": p.num_images_per_prompt, "response_format": "b64_json"}
    if p.width and p.height:
        body["size"] = f"{p.width}x{p.height}"
    if p.response_format in ("png", "jpeg", "webp"):
        body["output_format"] = p.response_format
    for name in ("negative_prompt", "num_inference_steps", "guidance_scale", "seed", "priority", "slo_ms"):
        if getattr(p, name) is not None:
            body[name] = getattr(p, name)
    if p.loras:  # `disagg bench --http URL --loras N`
        body["loras"] = [{"name": r.name, "scale": r.scale} for r in p.loras]
    return body


class HttpLoadClient:
    """Drives POST /v1/images/generations; status comes from GET /stats."""

    def __init__(self, url: str, api_key: str = ""):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def status(self) -> StatusReport:
        return asyncio.run(self._status())

    async def _status(self) -> StatusReport:
        import aiohttp

        try:
            async with aiohttp.ClientSession(headers=self.headers) as http:
                async with http.get(f"{self.url}/stats", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status != 200:
                        raise Unreachable(f"{self.url}/stats answered {r.status}: {await r.text()}")
                    return msgspec.convert(await r.json(), StatusReport, str_keys=True)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise Unreachable(f"cannot reach the gateway at {self.url}: {exc}") from None

    def run_all(self, params, concurrency: int = 1, arrivals: list[float] | None = None, **_ignored) -> list[Outcome]:
        return asyncio.run(self._run_all(list(params), concurrency, arrivals))

    async def _run_all(self, params: list[GenerationParams], concurrency: int, arrivals) -> list[Outcome]:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=max(concurrency, 1) if arrivals is None else 0)
        outcomes: list[Outcome | None] = [None] * len(params)
        start = time.monotonic()
        async with aiohttp.ClientSession(headers=self.headers, connector=connector) as http:
            async def one(k: int) -> None:
                if arrivals is not None:
                    await asyncio.sleep(max(0.0, start + arrivals[k] - time.monotonic()))
                p, rid = params[k], new_request_id()
                t0 = time.monotonic()
                try:
                    async with http.post(f"{self.url}/v1/images/generations", json=image_body(p),
                                         headers={"X-Request-Id": rid}) as r:
                        doc = await r.json(content_type=None)
                except (aiohttp.ClientError, ValueError) as exc:
                    outcomes[k] = Outcome(rid, p, False, f"HTTP: {exc}", latency_s=time.monotonic() - t0)
                    return
                latency = time.monotonic() - t0
                if r.status != 200:
                    outcomes[k] = Outcome(rid, p, False, f"HTTP {r.status}: {doc.get('error', {}).get('message')}",
                                          latency_s=latency)
                    return
                extra = doc.get("disagg", {})
                outcomes[k] = Outcome(rid, p, True, None, [base64.b64decode(d["b64_json"]) for d in doc["data"]],
                                      doc.get("output_format", "png"), extra.get("seed"), extra.get("timings", {}),
                                      latency, extra.get("attempts", 1))

            if arrivals is not None:
                await asyncio.gather(*(one(k) for k in range(len(params))))
            else:
                queue = iter(range(len(params)))

                async def worker() -> None:
                    for k in queue:
                        await one(k)

                await asyncio.gather(*(worker() for _ in range(min(concurrency, len(params)))))
        return [o for o in outcomes if o is not None]
