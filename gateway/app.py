"""The gateway's FastAPI application: routes, authentication, errors and the image store."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import os
import re
import signal
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from client import Unreachable
from client.aio import AsyncClient
from gateway.activity import Activity
from gateway.errors import ApiError, from_outcome
from gateway.images import MAX_EDIT_BODY_BYTES, parse_edit_request, parse_image_request, to_params
from gateway.metrics import Metrics
from gateway.store import BoundedCache
from gateway.videos import add_video_routes
from settings.process import GatewaySettings
from transport.parent import LauncherWatch

MIB = 1024 * 1024
log = logging.getLogger("disagg.gateway")

#: the largest request body read (a prompt is at most 20,000 characters)
MAX_BODY_BYTES = 1024 * 1024
CONTENT_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp", "mp4": "video/mp4"}
_REQUEST_ID = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")
GATEWAY_BEAT_S = 1.0
#: how often a waiting image request checks that its HTTP client is still there
DISCONNECT_POLL_S = 0.1
#: routes that answer without the API key (load balancers, Kubernetes, Prometheus; the static page,
#: whose own requests carry the key)
OPEN_ROUTES = {"/health", "/liveness", "/metrics", "/", "/favicon.ico"}
PAGE = Path(__file__).resolve().parent / "static" / "index.html"
#: response_format=url images: the URL holds an unguessable 128-bit id, so it opens without the key (it goes
#: into an <img>, or is shared), and only for image_ttl_s
_IMAGE_URL = re.compile(r"^/v1/images/[0-9a-f]{32}/content$")


def model_name(model: str) -> str:
    """The model's id for clients: a folder checkpoint's folder name, not the server's path (L1); a hub id or a
    built-in name as it is. Requests may name either."""
    return model.rstrip("/").rsplit("/", 1)[-1] if model.startswith("/") else model


def is_open(path: str) -> bool:
    """Whether a route answers without the API key."""
    return path in OPEN_ROUTES or bool(_IMAGE_URL.match(path))


async def _beat(client: AsyncClient, url: str) -> None:
    """Once a second: `disagg status` and the live table list this gateway."""
    restarts = int(os.environ.get("DISAGG_RESTARTS", "0"))
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
    metrics = Metrics()
    h = settings.http
    store = BoundedCache(h.image_store_max, h.image_store_mib * MIB, h.image_ttl)
    recent = BoundedCache(h.recent_max, h.recent_mib * MIB)
    activity = Activity()
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        curve = None
        if settings.keys:
            from transport.auth import client_curve

            curve = client_curve(Path(settings.keys))
        client = AsyncClient(settings.endpoint, curve=curve)
        await client.start()
        state["client"] = client
        tasks = [asyncio.create_task(_beat(client, f"http://{h.host}:{h.port}"))]
        if os.environ.get("DISAGG_RUN_ID"):
            tasks.append(asyncio.create_task(_exit_with_launcher()))
        log.info("gateway for %s", settings.endpoint)
        yield
        for task in tasks:
            task.cancel()
        await client.close()

    app = FastAPI(title="disagg", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def client() -> AsyncClient:
        return state["client"]

    class CountAndAuthenticate:
        """Counts every answer by route and code, and checks the API key. Plain ASGI (not Starlette's
        BaseHTTPMiddleware, which hides a client's disconnect from the route that waits for it)."""

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
                if h.api_key and not is_open(scope["path"]):
                    scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
                    if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), h.api_key.encode()):
                        raise ApiError(401, "missing or wrong API key: send Authorization: Bearer KEY",
                                       code="invalid_api_key")
                await self.inner(scope, receive, counting_send)
            except ApiError as exc:
                await exc.response()(scope, receive, counting_send)
            finally:
                route = getattr(scope.get("route"), "path", "unmatched")
                metrics.http.labels(route, scope["method"], str(code["status"])).inc()

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

    async def status_or_503():
        try:
            return await client().status()
        except Unreachable as exc:
            raise ApiError(503, str(exc), code="orchestrator_unreachable", headers={"Retry-After": "5"}) from None

    async def served_model() -> str:
        report = await status_or_503()
        return next((i.model for i in report.instances if i.model), "")

    async def submit_unless_gone(request: Request, rid: str, params):
        """The request's Outcome; None when the HTTP client disconnected first (then it is cancelled)."""
        task = asyncio.ensure_future(client().submit(rid, params))
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                await client().cancel(rid)
                await task
                return None

    # --- images ---------------------------------------------------------------------------------

    @app.post("/v1/images/generations")
    async def images_generations(request: Request):
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"a body of {len(body)} bytes is over the {MAX_BODY_BYTES}-byte limit", code="too_large")
        req = parse_image_request(body)
        return await answer_images(request, req, to_params(req))

    @app.post("/v1/images/edits")
    async def images_edits(request: Request):
        """OpenAI's images.edit: multipart with `image` (or `image[]`), an optional `mask`, the fields of
        generations and `strength`; the model's task follows from the inputs (edit, img2img, inpaint)."""
        size = int(request.headers.get("content-length") or 0)
        if size > MAX_EDIT_BODY_BYTES:
            raise ApiError(413, f"a body of {size} bytes is over the {MAX_EDIT_BODY_BYTES}-byte limit", code="too_large")
        req, params = await parse_edit_request(request)
        return await answer_images(request, req, params)

    async def answer_images(request: Request, req, params):
        """Run one image request (generations or edits) and answer as OpenAI's images API does."""
        if req.model:
            model = await served_model()
            if req.model not in (model, model.rstrip("/").rsplit("/", 1)[-1]):
                raise ApiError(404, f"model {req.model!r} is not served here (this deployment serves {model!r})",
                               param="model", code="model_not_found")
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex[:12]
        if not _REQUEST_ID.match(rid):
            raise ApiError(400, "X-Request-Id: 1-128 characters of A-Z a-z 0-9 _ . : @ -", param="X-Request-Id")
        headers = {"X-Request-Id": rid}
        asked = hashlib.sha1(msgspec.msgpack.encode(params)).hexdigest()
        answered = recent.get(rid)
        if answered is not None:  # a resubmission of a finished request: the same answer, not a second run
            if answered[0] != asked:
                raise ApiError(409, f"X-Request-Id {rid!r} was used for a request with other parameters; send new "
                                    "requests under new ids", param="X-Request-Id", code="duplicate_request_id",
                               headers=headers)
            return JSONResponse(answered[1], headers=headers)
        outcome = await submit_unless_gone(request, rid, params)
        if outcome is None:  # the client hung up: the request was cancelled, nobody reads an answer
            return Response(status_code=499, headers=headers)
        metrics.observe(outcome.ok, outcome.latency_s, outcome.timings)
        activity.record(outcome.ok, outcome.latency_s)
        if not outcome.ok:
            err = from_outcome(outcome)
            err.headers.update(headers)
            raise err
        fmt = outcome.image_format
        data = []
        for image in outcome.images:
            if req.response_format == "url":
                key = uuid.uuid4().hex
                store.put(key, (image, CONTENT_TYPES.get(fmt, "application/octet-stream")), len(image))
                data.append({"url": f"{str(request.base_url).rstrip('/')}/v1/images/{key}/content",
                             "revised_prompt": req.prompt})
            else:
                data.append({"b64_json": base64.b64encode(image).decode(), "revised_prompt": req.prompt})
        width, height = outcome.resolved.get("width"), outcome.resolved.get("height")
        doc = {"id": rid, "created": int(time.time()), "data": data, "output_format": fmt,
               "size": f"{width}x{height}" if width and height else req.size,
               "disagg": {"request_id": rid, "seed": outcome.seed, "attempts": outcome.attempts,
                          "timings": outcome.timings, "model": outcome.resolved.get("model")}}
        recent.put(rid, (asked, doc), sum(len(d.get("b64_json", "")) for d in data))
        if outcome.images:
            activity.show(rid, req.prompt, doc["size"], outcome.latency_s, outcome.images[0])
        return JSONResponse(doc, headers=headers)

    add_video_routes(app, client, served_model)

    @app.get("/v1/images/{image_id}/content")
    async def image_content(image_id: str):
        item = store.get(image_id)
        if item is None:
            raise ApiError(404, f"no image {image_id!r} (unknown, or older than {h.image_ttl:g} s)",
                           param="image_id", code="not_found")
        return Response(item[0], media_type=item[1])

    # --- the deployment -------------------------------------------------------------------------

    @app.get("/")
    async def page():
        """The web page: the live instance table and a prompt form (static; its requests carry the key)."""
        return Response(PAGE.read_bytes(), media_type="text/html; charset=utf-8")

    @app.get("/recent")
    async def recent_activity():
        """What the page charts: this gateway's requests per 10 s over the last 5 minutes (rate, failures,
        p50/p95 latency) and its last images with their prompts (thumbnails)."""
        return activity.doc()

    @app.get("/favicon.ico")
    async def favicon():
        return Response(status_code=204)

    @app.get("/liveness")
    async def liveness():
        return {"status": "ok"}

    @app.get("/health")
    async def health():
        """200 once every role has a ready instance. 503 otherwise, with `code` telling why: the orchestrator
        cannot be reached (`orchestrator_unreachable`: down), it is stopping (`unavailable`), a role has no
        instance at all (`no_instance`: none has joined yet, or all were stopped), or its instances are
        still loading (`not_ready`)."""
        report = await status_or_503()
        if report.orchestrator.get("state") != "ready":
            raise ApiError(503, f"the deployment is {report.orchestrator.get('state')}", code="unavailable",
                           headers={"Retry-After": "5"})
        roles = ("monolith",) if any(i.role == "monolith" for i in report.instances) else ("encoder", "denoiser", "decoder")
        live = {r: [i for i in report.instances if i.role == r and i.state != "dead"] for r in roles}
        absent = [r for r in roles if not live[r]]
        if absent:
            waited = ", ".join(f"{r} (none for {float(report.orchestrator.get(f'unserved_{r}_s', 0)):.0f} s)"
                               for r in absent)
            raise ApiError(503, f"no instance of {waited}: waiting for one to register", code="no_instance",
                           headers={"Retry-After": "5"})
        missing = [r for r in roles if not any(i.state == "ready" for i in live[r])]
        if missing:
            what = ", ".join(f"{r} ({', '.join(sorted({i.state for i in live[r]}))})" for r in missing)
            raise ApiError(503, f"no ready instance of {what}", code="not_ready", headers={"Retry-After": "2"})
        return {"status": "ok"}

    def model_card(model: str) -> dict:
        return {"id": model_name(model), "object": "model", "created": 0, "owned_by": "disagg"}

    @app.get("/v1/models")
    async def models():
        model = await served_model()
        return {"object": "list", "data": [model_card(model)] if model else []}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        served = await served_model()
        if model_id not in (served, model_name(served)):
            raise ApiError(404, f"model {model_id!r} is not served here (this deployment serves {served!r})",
                           param="model", code="model_not_found")
        return model_card(served)

    @app.get("/v1/model_info")
    async def model_info():
        served = await served_model()
        return {"model_path": served, "is_generation": True}

    @app.get("/stats")
    async def stats():
        return JSONResponse(msgspec.to_builtins(await status_or_503()))

    @app.get("/metrics")
    async def prometheus():
        try:
            metrics.status.report = await client().status()
        except Unreachable:
            metrics.status.report = None  # the gateway's own metrics still answer
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
