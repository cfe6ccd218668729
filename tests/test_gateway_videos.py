"""The HTTP gateway's video jobs (/v1/videos) with the official `openai` client, on the shared deployment of the tiny
Wan 2.1 checkpoint (conftest.checkpoint): create, retrieve, download, progress from the denoising steps, delete
cancels, and the requests refused at create."""


from __future__ import annotations

import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e

#: the video tests run on the shared deployment of the tiny Wan 2.1 checkpoint (conftest.checkpoint)
ON_WAN = pytest.mark.parametrize("checkpoint", ["wan21"], indirect=True)


@pytest.fixture
def wan(checkpoint):
    return checkpoint


@ON_WAN
def test_videos_create_retrieve_download_with_the_openai_client(wan):
    import imageio.v3 as iio

    api = openai.OpenAI(base_url=wan.http + "/v1", api_key="unused", max_retries=0)
    job = api.videos.create(prompt="a cat on a beach", size="32x32",
                            extra_body={"num_frames": 9, "num_inference_steps": 2, "seed": 3})
    assert job.status == "queued" and job.progress == 0 and job.object == "video"
    with pytest.raises(openai.NotFoundError):  # not ready yet
        api.videos.download_content(job.id)
    seen = [job.progress]
    deadline = time.monotonic() + 120
    while job.status not in ("completed", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
        job = api.videos.retrieve(job.id)
        seen.append(job.progress)
    assert job.status == "completed" and job.progress == 100 and job.size == "32x32", job
    assert seen == sorted(seen)  # progress never goes back
    frames = iio.imread(api.videos.download_content(job.id).read(), extension=".mp4")
    assert frames.shape == (9, 32, 32, 3)
    listed = api.videos.list()
    assert listed.data[0].id == job.id
    r = httpx.get(f"{wan.http}/v1/videos/{job.id}", timeout=10)
    assert r.headers["openai-poll-after-ms"] == "1000"


@ON_WAN
def test_video_progress_comes_from_the_denoising_steps(wan):
    """A job long enough for heartbeats to report its steps mid-way (once a second), followed on its event
    stream (GET /v1/videos/{id}/events), as image streams carry their previews."""
    import json

    # ~4 s here (tiny Wan at 256x256, 33 frames, 30 steps): several heartbeats report its steps
    r = httpx.post(wan.http + "/v1/videos", json={"prompt": "a slow one", "size": "256x256", "num_frames": 33,
                                                  "num_inference_steps": 30}, timeout=10)
    assert r.status_code == 200, r.text
    vid = r.json()["id"]
    events = []
    with httpx.stream("GET", f"{wan.http}/v1/videos/{vid}/events", timeout=240) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    *progress, last = events
    assert last["type"] == "video.completed" and last["progress"] == 100 and last["id"] == vid, last
    assert all(e["type"] == "video.progress" for e in progress)
    middle = [e["progress"] for e in progress if e["status"] == "in_progress" and 5 < e["progress"] < 95]
    assert middle and middle == sorted(middle), progress
    assert httpx.get(f"{wan.http}/v1/videos/{vid}", timeout=10).json()["status"] == "completed"


@ON_WAN
def test_deleting_a_running_video_job_cancels_it(wan):
    r = httpx.post(wan.http + "/v1/videos", json={"prompt": "never mind", "size": "256x256", "num_frames": 33,
                                                  "num_inference_steps": 400}, timeout=10)  # ~45 s if not cancelled
    vid = r.json()["id"]
    deadline = time.monotonic() + 60
    while httpx.get(wan.http + "/stats", timeout=10).json()["queues"]["denoiser"] or not any(
            i["role"] == "denoiser" and i["free_slots"] < i["capacity"]
            for i in httpx.get(wan.http + "/stats").json()["instances"]):
        assert time.monotonic() < deadline, "the job never reached its denoiser"
        time.sleep(0.1)
    before = httpx.get(wan.http + "/stats", timeout=10).json()["requests"]
    gone = httpx.delete(f"{wan.http}/v1/videos/{vid}", timeout=10)
    assert gone.status_code == 200 and gone.json() == {"id": vid, "object": "video.deleted", "deleted": True}
    t0 = time.monotonic()
    while True:
        stats = httpx.get(wan.http + "/stats", timeout=10).json()
        if all(i["free_slots"] == i["capacity"] for i in stats["instances"]) and not any(stats["queues"].values()):
            break
        assert time.monotonic() - t0 < 10, stats
        time.sleep(0.05)
    assert stats["requests"]["cancelled"] == before["cancelled"] + 1
    assert stats["requests"]["completed"] == before["completed"]
    assert httpx.get(f"{wan.http}/v1/videos/{vid}", timeout=10).status_code == 404


@ON_WAN
def test_bad_video_requests_are_400_naming_the_field(wan):
    api = openai.OpenAI(base_url=wan.http + "/v1", api_key="unused", max_retries=0)
    for kwargs, param in ((dict(size="tall"), "size"), (dict(extra_body={"num_frames": 0}), "num_frames"),
                          (dict(extra_body={"frames": 3}), "frames")):
        with pytest.raises(openai.BadRequestError) as info:
            api.videos.create(prompt="a cat", **kwargs)
        assert info.value.body["param"] == param, info.value.body
    assert httpx.get(wan.http + "/v1/videos/nope", timeout=10).status_code == 404


@ON_WAN
def test_video_jobs_that_would_certainly_fail_are_refused_at_create(wan):
    """Issue 22 M6: OpenAI's seconds 8 and 12 (beyond the 81 frames Wan makes), sizes over the limit and videos
    asked of an image model (next test) were accepted as queued, then failed."""
    videos = openai.OpenAI(base_url=wan.http + "/v1", api_key="unused", max_retries=0).videos
    for kwargs, param, words in ((dict(size="32x32", seconds="8"), "seconds", "129 frames"),
                                 (dict(size="32x32", seconds="12"), "seconds", "at most 81"),
                                 (dict(size="4096x4096", seconds="4"), "size", "maximum"),
                                 (dict(size="32x32", extra_body={"num_frames": 1000}), "num_frames", "maximum of 81")):
        with pytest.raises(openai.BadRequestError) as info:
            videos.create(prompt="a cat", **kwargs)
        assert info.value.body["param"] == param and words in info.value.body["message"], info.value.body

