"""The deployment's own routes: the web page and its chart data, health and liveness, models, stats, metrics."""

from __future__ import annotations

from pathlib import Path

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from disagg.client import Unreachable
from disagg.gateway.errors import ApiError
from disagg.gateway.state import caller_of, gateway_of, model_name

router = APIRouter()
PAGE = Path(__file__).resolve().parent.parent / "static" / "index.html"


@router.get("/")
async def page():
    """The web page: the live instance table and a prompt form (static; its requests carry the key)."""
    return Response(PAGE.read_bytes(), media_type="text/html; charset=utf-8")


@router.get("/recent")
async def recent_activity(request: Request):
    """What the page charts: this gateway's requests per 10 s over the last 5 minutes (rate, failures,
    p50/p95 latency) and the last images of the caller's API key (every key's for an admin key) with their
    prompts (thumbnails)."""
    return gateway_of(request).activity.doc(caller_of(request))


@router.get("/favicon.ico")
async def favicon():
    return Response(status_code=204)


@router.get("/liveness")
async def liveness():
    return {"status": "ok"}


@router.get("/health")
async def health(request: Request):
    """200 once every role has a ready instance. 503 otherwise, with `code` telling why: the orchestrator
    cannot be reached (`orchestrator_unreachable`: down), it is stopping (`unavailable`), a role has no
    instance at all (`no_instance`: none has joined yet, or all were stopped), or its instances are
    still loading (`not_ready`)."""
    report = await gateway_of(request).status_or_503()
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


def adapter_card(name: str, model: str) -> dict:
    """A LoRA adapter, listed as vLLM lists one: its parent is the base model."""
    return {**model_card(name), "id": name, "parent": model_name(model), "root": model_name(model)}


@router.get("/v1/models")
async def models(request: Request):
    gw = gateway_of(request)
    model = await gw.served_model()
    if not model:
        return {"object": "list", "data": []}
    return {"object": "list", "data": [model_card(model), *(adapter_card(a, model) for a in await gw.adapters())]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    served = await gateway_of(request).served_model()
    if model_id in await gateway_of(request).adapters():
        return adapter_card(model_id, served)
    if model_id not in (served, model_name(served)):
        raise ApiError(404, f"model {model_id!r} is not served here (this deployment serves {model_name(served)!r})",
                       param="model", code="model_not_found")
    return model_card(served)


@router.get("/v1/model_info")
async def model_info(request: Request):
    served = await gateway_of(request).served_model()
    return {"model_path": model_name(served), "is_generation": True}  # a folder's name, never the server's path


@router.get("/stats")
async def stats(request: Request):
    return JSONResponse(msgspec.to_builtins(await gateway_of(request).status_or_503()))


@router.get("/metrics")
async def prometheus(request: Request):
    gw = gateway_of(request)
    try:
        gw.metrics.status.report = await gw.client.status()
    except Unreachable:
        gw.metrics.status.report = None  # the gateway's own metrics still answer
    return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)
