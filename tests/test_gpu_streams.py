"""Review M1 on the CPU: a handoff waits for its own request's compute and its own copies only. torch.cuda's
streams and events are replaced by a model (FakeCuda) that records whose work each host wait waited for; the
real streams are checked in test_gpu.py on a GPU machine."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from disagg.transport.data.engines import EngineOptions, make_engine
from disagg.transport.data.pool import CudaPool, Pool
from disagg.transport.wire.messages import Run
from tests.test_gpu_paths import HANDLE, source


class FakeCuda:
    """torch.cuda's streams and events as a model: each queued op depends on the op before it on its stream and
    on what the stream was told to wait for; a host wait records every compute op it had to wait for (the
    closure of what it synchronised), so a test sees whose work a handoff waited behind."""

    def __init__(self):
        self.default = self.Stream()
        self.local = threading.local()
        #: (thread name, compute ops waited for) per host wait
        self.waits: list[tuple[str, set[str]]] = []
        #: called on every host wait before it is noted (another thread queues work meanwhile)
        self.on_wait = lambda: None
        fake = self

        class Event:
            def __init__(self, *args, **kwargs):
                self.op = None

            def record(self, stream=None):
                stream = stream or fake.current_stream()
                self.op = stream.ops[-1] if stream.ops else None

            def synchronize(self):
                fake.wait_for(self.op)

        self.Event = Event

    class Stream:
        def __init__(self, *args, **kwargs):
            self.ops: list[tuple[str, tuple]] = []

        def queue(self, label: str, deps: tuple = ()) -> tuple:
            op = (label, deps + ((self.ops[-1],) if self.ops else ()))
            self.ops.append(op)
            return op

        def wait_event(self, event):
            if event.op is not None:
                self.queue("wait", (event.op,))

        def wait_stream(self, other):
            if other.ops:
                self.queue("wait", (other.ops[-1],))

        def synchronize(self):
            fake_cuda_of[id(self)].wait_for(self.ops[-1] if self.ops else None)

    def current_stream(self, device=None):
        return getattr(self.local, "stream", None) or self.default

    @contextlib.contextmanager
    def stream(self, s):
        before = getattr(self.local, "stream", None)
        self.local.stream = s
        try:
            yield
        finally:
            self.local.stream = before

    def wait_for(self, op) -> None:
        self.on_wait()
        seen, todo = set(), [op] if op is not None else []
        while todo:
            label, deps = todo.pop()
            seen.add(label)
            todo.extend(deps)
        self.waits.append((threading.current_thread().name, seen - {"wait"}))

    def install(self, monkeypatch) -> None:
        fake = self

        class Stream(FakeCuda.Stream):
            def __init__(self, *args, **kwargs):
                super().__init__()
                fake_cuda_of[id(self)] = fake

        fake_cuda_of[id(self.default)] = self
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(torch.cuda, "stream", self.stream)


fake_cuda_of: dict[int, FakeCuda] = {}


class ModelCudaPool(CudaPool):
    """A CudaPool's own stream and event logic over FakeCuda, its bytes in host memory."""

    def __init__(self):
        Pool.__init__(self, "model-cuda", 1 << 20)
        self.device = "cuda:0"
        self.buffer = torch.zeros(1 << 20, dtype=torch.uint8)
        self.ipc, self.ipc_error = HANDLE, ""
        self._streams = threading.local()
        self.copy_stream = torch.cuda.Stream()  # what a single copy stream per pool would be

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)  # no pinned memory without CUDA


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    return fake


def test_a_finished_requests_stage_waits_for_its_own_compute_not_for_work_queued_after(fake_cuda):
    from disagg.roles.compute import StageRunner
    from disagg.roles.stage import StageOutput
    from disagg.transport.wire.messages import GenerationParams, Staged

    pool = ModelCudaPool()
    reports = []

    class Stage:
        role, turn, turns = "encoder", contextlib.nullcontext(), None

        class adapter:
            defaults = staticmethod(lambda: {})

        def ticket(self, *args):
            return None

        def run(self, params, inputs, step, ticket=None):
            fake_cuda.default.queue("mine")  # this request's kernels, queued on the one compute stream
            return StageOutput(tensors={"x": torch.ones(4)})

    def batcher_queues_the_next_step():  # while this request waited for its compute, another queued more
        if not any(label == "theirs" for label, _ in fake_cuda.default.ops):
            fake_cuda.default.queue("theirs")

    fake_cuda.on_wait = batcher_queues_the_next_step
    runner = StageRunner("encoder-0", pool, {}, lambda msg, frames=(): reports.append(msg))
    runner.stage = Stage()
    runner.execute(Run(request_id="r", attempt=1, params=GenerationParams(prompt="p")), [], time.perf_counter())
    assert [type(m) for m in reports if m is not None] == [Staged], reports
    assert fake_cuda.waits and all(waited == {"mine"} for _, waited in fake_cuda.waits), fake_cuda.waits


def test_a_pull_does_not_queue_behind_another_threads_stage_that_waits_for_compute(fake_cuda):
    pool = ModelCudaPool()
    engine = make_engine("cuda-ipc", pool, EngineOptions(visible_gpus=(0,)))
    engine._open = lambda src: torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8)
    fake_cuda.default.queue("their step")  # a denoiser's step, still running: its preview is staged after it
    preview = threading.Thread(target=pool.stage, args=("denoiser-0", {"latents": torch.ones(8)}), name="preview")
    preview.start()
    preview.join()
    dst = torch.empty(64, dtype=torch.uint8)
    engine.read(source("encoder-0", "pool-e"), dst, [])
    assert torch.equal(dst, torch.arange(64, dtype=torch.uint8))
    waits = dict(fake_cuda.waits)
    assert waits["preview"] == {"their step"}  # a preview copies the latents once its step has made them
    assert waits[threading.current_thread().name] == set(), "the pull waited for another request's compute"
