"""The gateway's FastAPI application: the routes (disagg/gateway/routes/), authentication, errors, beats."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from disagg.client import Unreachable
from disagg.client.aio import AsyncClient
from disagg.gateway.errors import ApiError
from disagg.gateway.limits import MIB, BodyLimits
from disagg.gateway.routes import images, operations, videos
from disagg.gateway.state import Gateway
from disagg.gateway.tenants import NOBODY, Keys
from disagg.settings.process import GatewaySettings
from disagg.transport.environment import DISAGG_RESTARTS, DISAGG_RUN_ID
from disagg.transport.parent import LauncherWatch

log = logging.getLogger("disagg.gateway")

GATEWAY_BEAT_S = 1.0
#: routes that answer without the API key (load balancers, Kubernetes, Prometheus; the static page,
#: whose own requests carry the key)
OPEN_ROUTES = {"/health", "/liveness", "/metrics", "/", "/favicon.ico"}
#: response_format=url images: the URL holds an unguessable 128-bit id, so it opens without the key (it goes
#: into an <img>, or is shared), and only for image_ttl_s
_IMAGE_URL = re.compile(r"^/v1/images/[0-9a-f]{32}/content$")


def is_open(path: str) -> bool:
    """Whether a route answers without the API key."""
    return path in OPEN_ROUTES or bool(_IMAGE_URL.match(path))


async def _beat(client: AsyncClient, url: str) -> None:
    """Once a second: `disagg status` and the live table list this gateway."""
    restarts = int(os.environ.get(DISAGG_RESTARTS, "0"))
    while True:
        try:
            await client.beat(url, os.getpid(), restarts)
        except Unreachable as exc:
            log.warning("%s", exc)
        await asyncio.sleep(GATEWAY_BEAT_S)


async def _exit_with_launcher() -> None:
    """Started by `disagg launch`: leave when it is gone (killed), as the roles do."""
    launcher = LauncherWatch()
    while True:
        await asyncio.sleep(1.0)
        if launcher.gone():
            log.warning("launcher is gone; exiting")
            os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's own graceful shutdown
            return


def make_app(settings: GatewaySettings) -> FastAPI:
    """The app: the routes of disagg/gateway/routes/ over one shared Gateway state, the API key and the counts."""
    gw = Gateway(settings)
    h = settings.http

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        curve = None
        if settings.keys:
            from disagg.transport.wire.auth import client_curve

            curve = client_curve(Path(settings.keys))
        gw.client = AsyncClient(settings.endpoint, curve=curve)
        await gw.client.start()
        tasks = [asyncio.create_task(_beat(gw.client, f"http://{h.host}:{h.port}"))]
        if os.environ.get(DISAGG_RUN_ID):
            tasks.append(asyncio.create_task(_exit_with_launcher()))
        log.info("gateway for %s", settings.endpoint)
        yield
        for task in tasks:
            task.cancel()
        await gw.client.close()

    app = FastAPI(title="disagg", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gw

    keys = Keys(h)

    class CountAndAuthenticate:
        """Counts every answer by route and code, and checks the API key: the request's Caller (its tenant,
        disagg/gateway/tenants.py) goes into the ASGI scope's state. Plain ASGI (not Starlette's BaseHTTPMiddleware,
        which hides a client's disconnect from the route that waits for it)."""

        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.inner(scope, receive, send)
            code = {"status": 500}

            async def counting_send(message):
                if message["type"] == "http.response.start":
                    code["status"] = message["status"]
                await send(message)

            try:
                caller = NOBODY
                if keys.required and not is_open(scope["path"]):
                    caller = keys.caller(dict(scope["headers"]).get(b"authorization", b""))
                    if caller is None:
                        raise ApiError(401, "missing or wrong API key: send Authorization: Bearer KEY",
                                       code="invalid_api_key")
                scope.setdefault("state", {})["caller"] = caller
                await self.inner(scope, receive, counting_send)
            except ApiError as exc:
                await exc.response()(scope, receive, counting_send)
            finally:
                route = getattr(scope.get("route"), "path", "unmatched")
                gw.metrics.http.labels(route, scope["method"], str(code["status"])).inc()

    # the body's limits inside the key check: a request without the key is refused before any of its body is read
    app.add_middleware(BodyLimits, budget=h.body_budget_mib * MIB, read_timeout=h.read_timeout,
                       body_timeout=h.body_timeout)
    app.add_middleware(CountAndAuthenticate)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        return ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError):
        return ApiError(400, str(exc), code="invalid_request").response()

    for module in (images, videos, operations):
        app.include_router(module.router)
    return app
