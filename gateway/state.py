"""What every route of one gateway shares: its settings, the orchestrator client, the image stores, metrics and
activity (`request.app.state.gateway`), and the helpers that ask the deployment."""

from __future__ import annotations

import asyncio
import collections

import msgspec
from fastapi import Request

from client import Unreachable
from client.aio import AsyncClient
from gateway.activity import Activity
from gateway.errors import ApiError
from gateway.metrics import Metrics
from gateway.store import BoundedCache
from settings.process import GatewaySettings
from transport.params import LoraRef

MIB = 1024 * 1024
#: how often a waiting request checks that its HTTP client is still there
DISCONNECT_POLL_S = 0.1


def model_name(model: str) -> str:
    """The model's id for clients: a folder checkpoint's folder name, not the server's path (L1); a hub id or a
    built-in name as it is. Requests may name either."""
    return model.rstrip("/").rsplit("/", 1)[-1] if model.startswith("/") else model


class Gateway:
    def __init__(self, settings: GatewaySettings):
        self.settings = h = settings.http
        self.endpoint, self.keys = settings.endpoint, settings.keys
        self.metrics = Metrics()
        self.store = BoundedCache(h.image_store_max, h.image_store_mib * MIB, h.image_ttl)
        #: completed answers kept for X-Request-Id resubmissions
        self.recent = BoundedCache(h.recent_max, h.recent_mib * MIB)
        self.activity = Activity()
        #: /v1/videos jobs, oldest first (gateway/routes/videos.py)
        self.video_jobs: collections.OrderedDict = collections.OrderedDict()
        self.client: AsyncClient | None = None  # set while the app runs (lifespan)

    async def status_or_503(self):
        try:
            return await self.client.status()
        except Unreachable as exc:
            raise ApiError(503, str(exc), code="orchestrator_unreachable", headers={"Retry-After": "5"}) from None

    async def served_model(self) -> str:
        report = await self.status_or_503()
        return next((i.model for i in report.instances if i.model), "")

    async def adapters(self) -> list[str]:
        """The LoRA adapters requests may name (loras.dir, loras.adapters)."""
        return list((await self.status_or_503()).loras)

    async def check_model(self, asked: str | None, params=None):
        """The served model; a 404 when the request names another. With `params`: (model, params), where a
        `model` that names a registered LoRA adapter is shorthand for that adapter at scale 1."""
        model = await self.served_model()
        if params is not None and asked and asked not in (model, model_name(model)) and asked in await self.adapters():
            if not params.loras:
                params = msgspec.structs.replace(params, loras=[LoraRef(name=asked)])
            return model, params
        if asked and asked not in (model, model.rstrip("/").rsplit("/", 1)[-1]):
            raise ApiError(404, f"model {asked!r} is not served here (this deployment serves {model!r})",
                           param="model", code="model_not_found")
        return model if params is None else (model, params)

    @staticmethod
    def key_priority(request: Request, params):
        """`params` at the priority of the API key the request came with (http.api_keys): that one unless it names
        a lower one; a higher one is refused (403)."""
        cap = getattr(request.state, "priority_cap", None)
        if cap is None:
            return params
        if params.priority is None:
            return msgspec.structs.replace(params, priority=cap)
        if params.priority > cap:
            raise ApiError(403, f"priority {params.priority} is above what this API key may ask ({cap})",
                           param="priority", code="priority_not_allowed")
        return params

    async def submit_unless_gone(self, request: Request, rid: str, params):
        """The request's Outcome; None when the HTTP client disconnected first (then it is cancelled)."""
        task = asyncio.ensure_future(self.client.submit(rid, params))
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                await self.client.cancel(rid)
                await task
                return None


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway
