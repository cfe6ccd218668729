"""OpenAI's Videos API: POST /v1/videos makes a job, GET polls it (progress from the denoising steps its role
reports), GET .../content downloads the MP4, DELETE cancels it for real. The jobs live in the gateway's state."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from disagg.client import Unreachable
from disagg.gateway.errors import ApiError, from_outcome
from disagg.gateway.fields import cache_report
from disagg.gateway.state import caller_of, gateway_of, model_name
from disagg.gateway.streams import sse
from disagg.gateway.videos import (
    DEFAULT_FPS,
    MAX_VIDEO_BYTES,
    POLL_AFTER_MS,
    VideoJob,
    jobs_quota,
    parse_video_request,
    progress_of,
    refuse_what_cannot_be_made,
    to_params,
)
from disagg.transport.wire.messages import GenerationParams

router = APIRouter()


async def run(gw, job: VideoJob, params: GenerationParams) -> None:
    outcome = await gw.client.submit(job.id, params)
    if outcome.ok and outcome.images:
        job.status, job.progress, job.data = "completed", 100, outcome.images[0]
        keep_bytes_bounded(gw.video_jobs, job, MAX_VIDEO_BYTES // gw.tenants)
        w, h = outcome.resolved.get("width"), outcome.resolved.get("height")
        if w and h:
            job.size = f"{w}x{h}"
        job.cache = cache_report(outcome.resolved).get("cache")
    elif job.status != "deleted":
        err = from_outcome(outcome)
        job.status, job.error = "failed", {"code": err.code or "generation_failed", "message": err.message}
    job.completed_at = int(time.time())


def keep_bytes_bounded(jobs: dict, newest: VideoJob, quota: int) -> None:
    """The MP4s of `newest`'s tenant within its share of MAX_VIDEO_BYTES: its oldest finished jobs go (another
    tenant's never do)."""
    own = [j for j in jobs.values() if j.data and j.tenant == newest.tenant]
    held = sum(len(j.data) for j in own)
    for old in [j for j in own if j is not newest]:
        if held <= quota:
            break
        held -= len(old.data)
        jobs.pop(old.id, None)


def get(request: Request, video_id: str) -> VideoJob:
    """The job, if the caller's API key made it (an admin key: any); else 404, as for an unknown id."""
    job = gateway_of(request).video_jobs.get(video_id)
    if job is None or not caller_of(request).sees(job.tenant):
        raise ApiError(404, f"no video job {video_id!r}", param="video_id", code="not_found")
    return job


def answer(job: VideoJob) -> JSONResponse:
    return JSONResponse(job.doc(), headers={"openai-poll-after-ms": str(POLL_AFTER_MS)})


@router.post("/v1/videos")

async def create(request: Request):
    gw = gateway_of(request)
    jobs = gw.video_jobs
    req = await parse_video_request(request)
    params = to_params(req)
    model = await gw.served_model()
    try:
        refuse_what_cannot_be_made(req, params, model_name(model), (await gw.client.status()).orchestrator)
    except Unreachable:
        pass  # the job then fails with the reason, as any request to an unreachable orchestrator does
    _, params = await gw.check_model(req.model, params)  # an adapter's name is shorthand for it at scale 1
    params = gw.key_priority(request, params)
    tenant = caller_of(request).tenant
    seconds = req.seconds if req.seconds is not None else (params.num_frames or 0) / (params.fps or DEFAULT_FPS)
    job = VideoJob(id=f"video_{uuid.uuid4().hex[:24]}", prompt=req.prompt, model=model_name(model),
                   size=req.size or "auto", seconds=f"{seconds:g}", tenant=tenant)
    # each API key holds its share of MAX_JOBS: past it, its own oldest job goes (one still running is cancelled);
    # another key's jobs never do
    own = [j for j in jobs.values() if j.tenant == tenant]
    for old in own[:max(0, len(own) - jobs_quota(gw.tenants) + 1)]:
        jobs.pop(old.id, None)
        if old.task is not None and not old.task.done():
            old.status = "deleted"
            await gw.client.cancel(old.id)
    jobs[job.id] = job
    job.task = asyncio.create_task(run(gw, job, params))
    return answer(job)


@router.get("/v1/videos")

async def list_jobs(request: Request, limit: int = 20, after: str | None = None, order: str = "desc"):
    """The caller's API key's jobs (an admin key: every key's)."""
    caller = caller_of(request)
    jobs = {k: j for k, j in gateway_of(request).video_jobs.items() if caller.sees(j.tenant)}
    if not 1 <= limit <= 100:
        raise ApiError(400, "limit must be 1 ... 100", param="limit", code="invalid_value")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order must be asc or desc", param="order", code="invalid_value")
    items = list(jobs.values()) if order == "asc" else list(reversed(jobs.values()))
    if after is not None:
        ids = [j.id for j in items]
        if after not in ids:
            raise ApiError(404, f"no video job {after!r}", param="after", code="not_found")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": [j.doc() for j in page], "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None, "has_more": len(items) > limit}


@router.get("/v1/videos/{video_id}")

async def retrieve(video_id: str, request: Request):
    job = get(request, video_id)
    await refresh(gateway_of(request), job)
    return answer(job)


async def refresh(gw, job: VideoJob) -> None:
    """A running job's status and progress, from its request's state (its denoising steps) at the orchestrator."""
    if job.status not in ("queued", "in_progress"):
        return
    try:
        states = await gw.client.query([job.id])
    except Unreachable:
        return
    state = states.states.get(job.id)
    if state is not None and state.state != "unknown" and job.status in ("queued", "in_progress"):
        status, progress = progress_of(state)
        job.status, job.progress = status, max(job.progress, progress)


#: how often a job's progress stream looks at its request
EVENTS_POLL_S = 0.25


@router.get("/v1/videos/{video_id}/events")
async def events(video_id: str, request: Request):
    """The job's progress as server-sent events, as the image streams carry partial images: `video.progress`
    ({id, status, progress}) at every change, then `video.completed` or `video.failed` (the job) and the end.
    Hanging up leaves the job running (DELETE cancels it)."""
    gw, job = gateway_of(request), get(request, video_id)

    async def stream():
        last = None
        while True:
            await refresh(gw, job)
            if job.status in ("completed", "failed", "deleted"):
                yield sse(f"video.{'completed' if job.status == 'completed' else 'failed'}",
                          {"type": f"video.{'completed' if job.status == 'completed' else 'failed'}", **job.doc()})
                return
            if (job.status, job.progress) != last:
                last = (job.status, job.progress)
                yield sse("video.progress", {"type": "video.progress", "id": job.id, "status": job.status,
                                             "progress": job.progress})
            await asyncio.sleep(EVENTS_POLL_S)

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.get("/v1/videos/{video_id}/content")

async def content(video_id: str, request: Request, variant: str = "video"):
    job = get(request, video_id)
    if variant != "video":
        raise ApiError(400, f"variant {variant!r}: only 'video' is served", param="variant", code="invalid_value")
    if job.status != "completed" or job.data is None:
        raise ApiError(404, f"video {video_id} is {job.status}, not ready", param="video_id", code="not_ready")
    return Response(job.data, media_type="video/mp4")


@router.delete("/v1/videos/{video_id}")

async def delete(video_id: str, request: Request):
    gw = gateway_of(request)
    job = get(request, video_id)
    if job.task is not None and not job.task.done():
        job.status = "deleted"
        await gw.client.cancel(job.id)
    gw.video_jobs.pop(video_id, None)
    return {"id": video_id, "object": "video.deleted", "deleted": True}
