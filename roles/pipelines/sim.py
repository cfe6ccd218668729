"""`sim:PROFILE`: stages that take the profile's time and move the real model's payload sizes.

Scheduling and transfer overheads can then be measured on a CPU without compute contention.
Roles placed on the same simulated device (`--gpus` with a sim model) take turns on it, as
they would on a real GPU: every busy period holds an exclusive lock on that device.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from contextlib import contextmanager

import torch
from PIL import Image

from roles.media import encode_image
from roles.pipelines.sim_profile import load_profile


class _SimState:
    """One request in a simulated batch."""

    def __init__(self, params: dict, steps: int):
        self.params = params
        self.steps_left = steps

    @property
    def done(self) -> bool:
        return self.steps_left <= 0


class SimAdapter:
    """Sleeps for each stage's simulated time; emits zero tensors of the real payload size."""

    #: no per-call state: an instance's threads may run it at once (they take turns on a simulated device)
    thread_safe = True

    def __init__(self, profile: str, role: str, device: str = "cpu", slowdown: float = 1.0):
        self.profile = load_profile(profile)
        self.slowdown = slowdown
        self.role = role
        self._zeros = torch.zeros(0)
        self._encoded: dict[str, bytes] = {}
        self._lock_fd = None
        self._thread_turn = threading.Lock()
        if device.startswith("sim:"):
            run = os.environ.get("DISAGG_RUN_ID", "local")
            path = f"/dev/shm/disagg-{run}-simdev-{device[4:]}"
            self._lock_fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        #: on a simulated device its computes take turns anyway (schedule slo orders them: roles/stage.py)
        self.one_device = self._lock_fd is not None

    @staticmethod
    def defaults() -> dict:
        return dict(width=1024, height=1024, num_inference_steps=4, guidance_scale=3.5, num_images_per_prompt=1, seed=0)

    @contextmanager
    def device_turn(self):
        if self._lock_fd is None:
            yield
            return
        # flock excludes other processes only (threads share the open file), so threads take turns first
        with self._thread_turn:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _busy(self, ms: float) -> None:
        if ms > 0:
            with self.device_turn():
                time.sleep(ms * self.slowdown / 1000)

    #: a request may carry an input image: the profile's `image` cost is added to the encoder's
    takes_images = True
    #: its payload's size follows the request's (the conditioning cache's key: roles/conditioning.py)
    conditioning_depends = ("width", "height", "num_frames")

    def _tensor(self, role: str, p: dict) -> dict[str, torch.Tensor]:
        with_image = role == "encoder" and p.get("image") is not None
        prof, pixels = self.profile.for_request(p)
        n = max(prof.payload(role, pixels, p["num_images_per_prompt"], with_image), 64) // 4
        if self._zeros.numel() < n:
            self._zeros = torch.zeros(n)
        # a view of one zero buffer: staging copies it into the pool anyway
        return {"x": self._zeros[:n]}

    def encode(self, p: dict) -> dict[str, torch.Tensor]:
        prof, pixels = self.profile.for_request(p)
        extra = prof.image.fixed_ms(pixels) if p.get("image") is not None else 0.0
        self._busy(prof.encoder.fixed_ms(pixels) + extra)
        return self._tensor("encoder", p)

    def denoise(self, inputs, p: dict, progress=None) -> dict[str, torch.Tensor]:
        prof, pixels = self.profile.for_request(p)
        cost = prof.denoiser
        self._busy(cost.fixed_ms(pixels))
        for _ in range(p["num_inference_steps"]):
            self._busy(cost.step_ms(pixels))
            if progress:
                progress(self._tensor("denoiser", p))  # the "latents" a preview is staged from
        return self._tensor("denoiser", p)

    # --- step-level batching (roles/batcher.py) ---

    @staticmethod
    def batch_key(p: dict):
        return (p["width"], p["height"], p.get("num_frames"))

    def denoise_start(self, inputs, p: dict) -> "_SimState":
        prof, pixels = self.profile.for_request(p)
        self._busy(prof.denoiser.fixed_ms(pixels))
        return _SimState(p, p["num_inference_steps"])

    def denoise_steps(self, states: list["_SimState"]) -> None:
        prof, pixels = self.profile.for_request(states[0].params)
        cost = prof.denoiser
        rows = sum(s.params["num_images_per_prompt"] for s in states)
        self._busy(cost.step_ms(pixels) * cost.batch_factor(pixels, rows))
        for s in states:
            s.steps_left -= 1

    def denoise_result(self, state: "_SimState") -> dict[str, torch.Tensor]:
        return self._tensor("denoiser", state.params)

    #: a video's decode calls `progress` between its latent frames, as a 3D VAE decodes them one by one
    decode_yields = True

    def decode(self, inputs, p: dict, progress=None) -> list[Image.Image]:
        prof, pixels = self.profile.for_request(p)
        chunks = prof.latent_frames(p.get("num_frames"))
        for k in range(chunks):
            if k and progress is not None:
                progress()
            self._busy(prof.decoder.fixed_ms(pixels) / chunks)
        return [Image.new("L", (1, 1), 0) for _ in range(p["num_images_per_prompt"])]

    def decode_encoded(self, inputs, p: dict, fmt: str, progress=None) -> list[bytes]:
        """decode(), already encoded: the image is always the same, so it is encoded once per format
        (encoding a blank image on every request would be simulated work no profile asked for)."""
        images = self.decode(inputs, p, progress)
        data = self._encoded.get(fmt)
        if data is None:
            data = self._encoded[fmt] = encode_image(images[0], fmt)
        return [data] * len(images)

    def components_loaded(self) -> dict[str, int]:
        return {}
