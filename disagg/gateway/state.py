"""What every route of one gateway shares: its settings, the orchestrator client, the image stores, metrics and
activity (`request.app.state.gateway`), and the helpers that ask the deployment."""

from __future__ import annotations

import asyncio
import collections

import msgspec
from fastapi import Request

from disagg.client import Unreachable
from disagg.client.aio import AsyncClient
from disagg.gateway.activity import Activity
from disagg.gateway.errors import ApiError
from disagg.gateway.metrics import Metrics
from disagg.gateway.store import BoundedCache
from disagg.gateway.tenants import NOBODY, Caller, Keys
from disagg.settings.process import GatewaySettings
from disagg.transport.wire.params import LoraRef

MIB = 1024 * 1024
#: how often a waiting request checks that its HTTP client is still there
DISCONNECT_POLL_S = 0.1


def model_name(model: str | None) -> str | None:
    """The model's id for clients: a folder checkpoint's folder name, not the server's path (L1); a hub id or a
    built-in name as it is. Requests may name either."""
    return model.rstrip("/").rsplit("/", 1)[-1] if model and model.startswith("/") else model


class Gateway:
    def __init__(self, settings: GatewaySettings):
        self.settings = h = settings.http
        self.endpoint, self.keys = settings.endpoint, settings.keys
        #: the tenants there can be (one per key; one without keys): per-tenant quotas divide by it
        self.tenants = Keys(h).tenants
        self.metrics = Metrics()
        self.store = BoundedCache(h.image_store_max, h.image_store_mib * MIB, h.image_ttl)
        #: completed answers kept for X-Request-Id resubmissions, by the request's id at the orchestrator (its
        #: tenant's, disagg/gateway/tenants.py upstream_id): another key's equal id is another entry
        self.recent = BoundedCache(h.recent_max, h.recent_mib * MIB)
        self.activity = Activity()
        #: /v1/videos jobs, oldest first (disagg/gateway/routes/videos.py), each with its tenant
        self.video_jobs: collections.OrderedDict = collections.OrderedDict()
        #: HTTP callers waiting on each request in flight (by its id at the orchestrator): callers of one tenant
        #: that sent the same X-Request-Id and parameters share one run, which is cancelled when the last hangs up
        self.waiting: collections.Counter[str] = collections.Counter()
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
        if asked and asked not in (model, model_name(model)):
            raise ApiError(404, f"model {asked!r} is not served here (this deployment serves {model_name(model)!r})",
                           param="model", code="model_not_found")
        return model if params is None else (model, params)

    @staticmethod
    def key_priority(request: Request, params):
        """`params` at the priority of the API key the request came with (http.api_keys): that one unless it names
        a lower one; a higher one is refused (403)."""
        cap = caller_of(request).priority_cap
        if cap is None:
            return params
        if params.priority is None:
            return msgspec.structs.replace(params, priority=cap)
        if params.priority > cap:
            raise ApiError(403, f"priority {params.priority} is above what this API key may ask ({cap})",
                           param="priority", code="priority_not_allowed")
        return params

    async def submit_unless_gone(self, request: Request, rid: str, params):
        """The request's Outcome (`rid`: its id at the orchestrator); None when the HTTP client disconnected first.
        Then the request is cancelled, unless another caller still waits on it (one of the same tenant that sent
        the same X-Request-Id and parameters): that one gets it."""
        task = asyncio.ensure_future(self.client.submit(rid, params))
        self.waiting[rid] += 1
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    return None
        finally:
            await self.leave(rid, task)

    async def leave(self, rid: str, task: asyncio.Future) -> None:
        """A caller of request `rid` is done with it (`task`: its wait): if it did not end and nobody else waits
        on it, it is cancelled."""
        self.waiting[rid] -= 1
        if self.waiting[rid] > 0:
            task.cancel()  # this caller's wait only: the run goes on for the others (client.submit shields it)
            return
        del self.waiting[rid]
        if not task.done():
            await self.client.cancel(rid)
            await asyncio.gather(task, return_exceptions=True)


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


def caller_of(request: Request) -> Caller:
    """Who sent the request (its API key's tenant; disagg/gateway/tenants.py)."""
    return getattr(request.state, "caller", NOBODY)
