"""`sim:PROFILE`: stages that take the profile's time and move the real model's payload sizes.

Scheduling and transfer overheads can then be measured on a CPU without compute contention.
Roles placed on the same simulated device (`--gpus` with a sim model) take turns on it, as
they would on a real GPU: every busy period holds an exclusive lock on that device.

The payloads are request-specific, so a wrong or mixed-up output shows (benchmarks/chaos_day.py): the
encoder's tensor is filled with a value derived from what conditions it (the conditioning cache's key:
prompts, guidance, images per prompt, adapters, size), the denoiser's latents with one derived from that
value, the seed, the adapters and the steps done (a preview's copy after step k differs from the final
latents), and the decoder's image is a tiny PNG whose pixels are a checksum of its input value and the
request's parameters (`image_checksum` reads it back). Each costs a hash and a `torch.full`.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import threading
import time
from contextlib import contextmanager

import torch
from PIL import Image

from disagg.roles.media import encode_image
from disagg.roles.pipelines.adapter import Capabilities, LoraSupport
from disagg.roles.pipelines.sim_profile import load_profile
from disagg.settings.devices import CLASSES
from disagg.transport.data.shm import pid_alive
from disagg.transport.environment import DISAGG_RUN_ID

#: bytes in a gigabyte (device memory is sold in them)
GB = 10**9


#: the payload values are integers below 2**23: a float32 holds them exactly
_VALUES = 1 << 23
#: the decoder's image: this many RGB pixels, one row, their bytes a checksum
IMAGE_PIXELS = 4


def _value(*parts) -> float:
    """A payload value from `parts` (repr-able): an integer in [1, 2**23), exact in a float32."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return float(int.from_bytes(digest, "little") % (_VALUES - 1) + 1)


def _loras(p: dict) -> tuple:
    """A request's adapters as (name, scale) pairs, whether LoraRef structs or dicts."""
    return tuple((r["name"], float(r.get("scale", 1.0))) if isinstance(r, dict) else (r.name, float(r.scale))
                 for r in p.get("loras") or ())


def encoder_value(p: dict) -> float:
    """What the encoder's tensor holds: from what the conditioning cache keys on (disagg/transport/wire/params.py
    conditioning_key) plus the input image, so a cache hit holds what a compute would."""
    image = p.get("image")
    image = hashlib.blake2b(image, digest_size=8).hexdigest() if image is not None else None
    return _value("encoder", p.get("prompt"), p.get("negative_prompt"), p.get("guidance_scale"),
                  p.get("num_images_per_prompt", 1), _loras(p), p.get("width"), p.get("height"), p.get("num_frames"),
                  image, p.get("mask") is not None and hashlib.blake2b(p["mask"], digest_size=8).hexdigest())


def latents_value(encoded: float, p: dict, steps_done: int) -> float:
    """What the denoiser's latents hold after `steps_done` of the request's steps."""
    return _value("latents", encoded, p.get("seed"), _loras(p), p.get("num_inference_steps"), steps_done,
                  p.get("width"), p.get("height"), p.get("num_frames"), p.get("num_images_per_prompt", 1))


def image_pixels(latents: float, p: dict, index: int) -> bytes:
    """The decoder's `index`th image's RGB pixels: a checksum of its input value and the request's parameters."""
    return hashlib.blake2b(repr(("image", latents, p.get("seed"), p.get("width"), p.get("height"),
                                 p.get("num_inference_steps"), p.get("num_frames"), index)).encode(),
                           digest_size=3 * IMAGE_PIXELS).digest()


def image_checksum(data: bytes) -> str:
    """A sim image's checksum (its pixels, hex) from its file's bytes, whatever the format's container."""
    with Image.open(io.BytesIO(data)) as im:
        return im.convert("RGB").tobytes().hex()


def expected_pixels(params: dict, steps_done: int | None = None, index: int = 0) -> bytes:
    """The pixels a sim decoder makes for a request (`params`: its fields, as a client sends them, seed set), or
    for its preview after `steps_done` steps: what a benchmark checks a sim image against, computing nothing."""
    import msgspec

    from disagg.transport.wire.params import GenerationParams

    given = {k: v for k, v in msgspec.structs.asdict(msgspec.convert(params, GenerationParams)).items() if v is not None}
    p = {**SimAdapter.defaults(), **given}
    steps = p["num_inference_steps"] if steps_done is None else steps_done
    return image_pixels(latents_value(encoder_value(p), p, steps), p, index)


def first_value(inputs) -> float:
    """The value a stage's input payload holds (0.0 when it has none: a unit test's empty inputs)."""
    x = inputs.get("x") if isinstance(inputs, dict) else None
    return float(x.reshape(-1)[0]) if x is not None and x.numel() else 0.0


class _SimState:
    """One request in a simulated batch."""

    def __init__(self, params: dict, steps: int, encoded: float = 0.0):
        self.params = params
        self.steps = steps
        self.steps_left = steps
        self.encoded = encoded

    @property
    def done(self) -> bool:
        return self.steps_left <= 0


class SimAdapter:
    """Sleeps for each stage's simulated time; emits tensors of the real payload size, each filled with one
    request-specific value (the module's docstring)."""

    def __init__(self, profile: str, role: str, device: str = "cpu", slowdown: float = 1.0, device_memory: int = 0,
                 device_class: str = ""):
        self.profile = load_profile(profile)
        self.slowdown = slowdown
        self.role = role
        #: its simulated device's memory (0: no limit) and class (`devices`): a compute that would not fit fails as
        #: out of memory, as on a GPU; the peak of its activations so far
        self.device_memory = device_memory
        self.device_class = device_class
        self.activation_peak = 0
        #: the weights the other instances on its simulated device hold (they take turns on it, so only their
        #: weights stay: each compute's activations come and go)
        self.others_bytes = 0
        #: a colocated replica whose device cannot hold every component: those it streams in from host memory for
        #: every request (stage -> bytes), at its device class's host-to-device bandwidth
        self.streamed = self.profile.streamed(device_memory, self.profile.reference_pixels) \
            if role == "monolith" and device_memory else {}
        self.host_to_device = CLASSES[device_class].host_to_device if device_class in CLASSES else 0.0
        self._zeros = torch.zeros(0)
        #: encoded images by (pixels, format): a request retried, or many alike, encodes once
        self._encoded: dict[tuple[bytes, str], bytes] = {}
        self._encoded_lock = threading.Lock()
        self._lock_fd = None
        self._thread_turn = threading.Lock()
        if device.startswith("sim:"):
            run = os.environ.get(DISAGG_RUN_ID, "local")
            # no pid ends its name (as a pool's does): the run's leftovers go once none of its processes lives
            path = f"/dev/shm/disagg-{run}-simdev{device[4:]}"
            self._lock_fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
            self.others_bytes = self._share()
        if device_memory and self.others_bytes + self.weights_bytes() > device_memory:
            others = f" beside the {self.others_bytes / GB:.1f} GB of the others on it" if self.others_bytes else ""
            raise torch.OutOfMemoryError(
                f"out of memory: {role} weights of sim:{profile} take {self.weights_bytes() / GB:.1f} GB{others}, more "
                f"than the {device_memory / GB:.0f} GB of its device ({device_class or device})")
        self.capabilities = Capabilities(
            batching=True,
            # no per-call state: an instance's threads may run it at once (they take turns on a simulated device)
            thread_safe=True,
            # on a simulated device its computes take turns anyway (schedule slo orders them: disagg/roles/stage.py)
            one_device=self._lock_fd is not None,
            previews=True,
            # a request may carry an input image: the profile's `image` cost is added to the encoder's
            image_inputs=True,
            # a video's decode calls `progress` between its latent frames, as a 3D VAE decodes them one by one
            decode_yields=True,
            encoded_output=True,
            # its weights and activations come from its profile, and its device's memory from `devices`
            memory_model=True,
            # its payload's size follows the request's (the conditioning cache's key: disagg/roles/extensions/conditioning.py)
            conditioning_depends=("width", "height", "num_frames"),
            # its adapters are the denoiser's weights, loaded and restored in its profile's times
            loras=LoraSupport.SIM)

    # --- memory (Capabilities.memory_model) ---

    def weights_bytes(self) -> int:
        """What it keeps on its device (a replica streaming some components: the others)."""
        return self.profile.weights(self.role) - sum(self.streamed.values())

    def _stream(self, stage: str) -> None:
        """A replica's component it does not keep: copied in before its stage (the device's copy, not its compute:
        the class's bandwidth, not its speed)."""
        nbytes = self.streamed.get(stage)
        if nbytes and self.host_to_device:
            with self.device_turn():
                time.sleep(nbytes / self.host_to_device * self.profile.time_scale)

    def _share(self) -> int:
        """Record this process's weights in its simulated device's file (under the device's lock; processes gone
        are dropped) and return the bytes the others there hold: memory is checked across every process on a
        device, as a GPU's is."""
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            os.lseek(self._lock_fd, 0, os.SEEK_SET)
            raw = os.read(self._lock_fd, 1 << 20)
            try:
                held = {int(pid): int(n) for pid, n in json.loads(raw or b"{}").items()}
            except (ValueError, AttributeError):
                held = {}
            held = {pid: n for pid, n in held.items() if pid != os.getpid() and pid_alive(pid)}
            others = sum(held.values())
            held[os.getpid()] = self.weights_bytes()
            os.ftruncate(self._lock_fd, 0)
            os.lseek(self._lock_fd, 0, os.SEEK_SET)
            os.write(self._lock_fd, json.dumps(held).encode())
            return others
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _fit(self, stage: str, p: dict, rows: int) -> None:
        """Fail as out of memory where `rows` of `p` in `stage` would not fit its device; note the peak."""
        prof, pixels = self.profile.for_request(p)
        act = prof.activations(stage, pixels, rows)
        self.activation_peak = max(self.activation_peak, act)
        need = self.others_bytes + self.weights_bytes() + act
        if self.device_memory and need > self.device_memory:
            raise torch.OutOfMemoryError(
                f"out of memory: {stage} of {rows} x {p['width']}x{p['height']}"
                f"{' x ' + str(p['num_frames']) + ' frames' if p.get('num_frames') else ''} needs {need / GB:.1f} GB "
                f"(weights {(self.others_bytes + self.weights_bytes()) / GB:.1f}, activations {act / GB:.1f}), more than the "
                f"{self.device_memory / GB:.0f} GB of its device ({self.device_class or 'simulated'})")

    def batch_limit(self, p: dict) -> int:
        """The most requests like `p` a denoising batch holds on its device (0: no limit)."""
        if not self.device_memory:
            return 0
        prof, pixels = self.profile.for_request(p)
        room = self.device_memory - self.others_bytes - self.weights_bytes()
        per = prof.activations("denoiser", pixels, p.get("num_images_per_prompt", 1))
        return max(1, room // per) if per else 0

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
                time.sleep(ms * self.slowdown * self.profile.time_scale / 1000)

    def _size(self, role: str, p: dict) -> int:
        with_image = role == "encoder" and p.get("image") is not None
        prof, pixels = self.profile.for_request(p)
        return max(prof.payload(role, pixels, p.get("num_images_per_prompt", 1), with_image), 64) // 4

    def _tensor(self, role: str, p: dict, value: float) -> dict[str, torch.Tensor]:
        return {"x": torch.full((self._size(role, p),), value)}

    def _step_latents(self, role: str, p: dict, value_of) -> dict[str, torch.Tensor]:
        """The latents after a step, for the progress callback: only a preview reads them, so a request without
        previews gets a view of one zero buffer (nothing to fill)."""
        if p.get("previews"):
            return self._tensor(role, p, value_of())
        n = self._size(role, p)
        if self._zeros.numel() < n:
            self._zeros = torch.zeros(n)
        return {"x": self._zeros[:n]}

    def encode(self, p: dict) -> dict[str, torch.Tensor]:
        prof, pixels = self.profile.for_request(p)
        self._fit("encoder", p, 1)
        self._stream("encoder")
        extra = prof.image.fixed_ms(pixels) if p.get("image") is not None else 0.0
        self._busy(prof.encoder.fixed_ms(pixels) + extra)
        return self._tensor("encoder", p, encoder_value(p))

    def denoise(self, inputs, p: dict, progress=None) -> dict[str, torch.Tensor]:
        prof, pixels = self.profile.for_request(p)
        self._fit("denoiser", p, p.get("num_images_per_prompt", 1))
        self._stream("denoiser")
        cost = prof.denoiser
        encoded = first_value(inputs)
        self._busy(cost.fixed_ms(pixels))
        steps = p["num_inference_steps"]
        for k in range(1, steps + 1):
            self._busy(cost.step_ms(pixels))
            if progress:  # the "latents" a preview is staged from
                progress(self._step_latents("denoiser", p, lambda: latents_value(encoded, p, k)))
        return self._tensor("denoiser", p, latents_value(encoded, p, steps))

    # --- step-level batching (disagg/roles/batcher.py) ---

    @staticmethod
    def batch_key(p: dict):
        return (p["width"], p["height"], p.get("num_frames"))

    def denoise_start(self, inputs, p: dict) -> "_SimState":
        prof, pixels = self.profile.for_request(p)
        self._stream("denoiser")
        self._busy(prof.denoiser.fixed_ms(pixels))
        return _SimState(p, p["num_inference_steps"], first_value(inputs))

    def denoise_steps(self, states: list["_SimState"]) -> None:
        prof, pixels = self.profile.for_request(states[0].params)
        cost = prof.denoiser
        rows = sum(s.params["num_images_per_prompt"] for s in states)
        self._fit("denoiser", states[0].params, rows)
        self._busy(cost.step_ms(pixels) * cost.batch_factor(pixels, rows))
        for s in states:
            s.steps_left -= 1

    def denoise_result(self, state: "_SimState") -> dict[str, torch.Tensor]:
        """The latents after the steps done so far: the result once done, a preview's copy before."""
        p, done = state.params, state.steps - max(state.steps_left, 0)
        value = lambda: latents_value(state.encoded, p, done)  # noqa: E731
        return self._tensor("denoiser", p, value()) if state.done else self._step_latents("denoiser", p, value)

    def _decode_pixels(self, inputs, p: dict, progress=None) -> list[bytes]:
        prof, pixels = self.profile.for_request(p)
        chunks = prof.latent_frames(p.get("num_frames"))
        self._fit("decoder", p, p.get("num_images_per_prompt", 1))
        self._stream("decoder")
        for k in range(chunks):
            if k and progress is not None:
                progress()
            self._busy(prof.decoder.fixed_ms(pixels) / chunks)
        latents = first_value(inputs)
        return [image_pixels(latents, p, i) for i in range(p.get("num_images_per_prompt", 1))]

    def decode(self, inputs, p: dict, progress=None) -> list[Image.Image]:
        return [Image.frombytes("RGB", (IMAGE_PIXELS, 1), px) for px in self._decode_pixels(inputs, p, progress)]

    #: images kept encoded (decode_encoded), the oldest forgotten first
    ENCODED_KEPT = 1024

    def decode_encoded(self, inputs, p: dict, fmt: str, progress=None) -> list[bytes]:
        """decode(), already encoded: each image is encoded once per format and kept (encoding on every request
        would be simulated work no profile asked for)."""
        out = []
        for px in self._decode_pixels(inputs, p, progress):
            data = self._encoded.get((px, fmt))
            if data is None:
                data = encode_image(Image.frombytes("RGB", (IMAGE_PIXELS, 1), px), fmt)
                with self._encoded_lock:  # an instance's threads decode at once
                    if len(self._encoded) >= self.ENCODED_KEPT:
                        self._encoded.pop(next(iter(self._encoded)), None)
                    self._encoded[(px, fmt)] = data
            out.append(data)
        return out

    def components_loaded(self) -> dict[str, int]:
        return {}
