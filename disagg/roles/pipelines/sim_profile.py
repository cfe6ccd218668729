"""Stage-time profiles for the `sim:NAME` model (disagg/roles/pipelines/sim_profiles/NAME.yaml); torch-free."""

from __future__ import annotations

import functools
from pathlib import Path

import msgspec
import yaml

#: the profiles `sim:NAME` names, shipped in the package (package data: a wheel install has them too)
PROFILE_DIR = Path(__file__).resolve().parent / "sim_profiles"


class StageCost(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """ms = base_ms + per_pixel_ms*px + steps*(per_step_ms + per_step_pixel_ms*px), then batch factor."""

    base_ms: float = 0.0
    per_pixel_ms: float = 0.0
    per_step_ms: float = 0.0
    per_step_pixel_ms: float = 0.0
    #: attention's quadratic part: ms per step per pixel^2 (video: pixels x latent frames)
    per_step_pixel2_ms: float = 0.0
    payload_bytes: int = 0
    payload_scales: bool = False  # payload grows with the request's pixels (latents)
    batch: dict[int, dict[int, float]] = {}
    #: device memory, in bytes: the weights this stage loads (parameters x 2, bf16), and the peak of its
    #: activations per request in a batch: a fixed part and one per latent token (pixels / pixels_per_token)
    weights_bytes: int = 0
    activation_bytes: int = 0
    activation_bytes_per_token: float = 0.0

    def step_ms(self, pixels: int) -> float:
        return self.per_step_ms + self.per_step_pixel_ms * pixels + self.per_step_pixel2_ms * pixels * pixels

    def fixed_ms(self, pixels: int) -> float:
        return self.base_ms + self.per_pixel_ms * pixels

    def batch_factor(self, pixels: int, size: int) -> float:
        """Step time at batch `size` / step time at batch 1, from the curve of the nearest resolution:
        linear between measured sizes and beyond the largest; no curve = no gain (factor = size)."""
        if size <= 1 or not self.batch:
            return float(max(size, 1))
        curve = sorted({1: 1.0, **self.batch[min(self.batch, key=lambda px: abs(px - pixels))]}.items())
        for (b0, f0), (b1, f1) in zip(curve, curve[1:]):
            if size <= b1:
                return f0 + (f1 - f0) * (size - b0) / (b1 - b0)
        (b0, f0), (b1, f1) = curve[-2], curve[-1]
        return f1 + (f1 - f0) / (b1 - b0) * (size - b1)


class LoraCost(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A sim model's LoRA adapters: any name is one (no files); loading one takes load_ms; an instance holds
    `slots` at once (0: loras.slots), and `host_slots` more in host memory (0: loras.host_slots), each copied back
    to the device in restore_ms."""

    load_ms: float = 0.0
    slots: int = 0
    host_slots: int = 0
    restore_ms: float = 0.0


class SimProfile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One simulated model: a cost per stage."""

    encoder: StageCost = msgspec.field(default_factory=StageCost)
    denoiser: StageCost = msgspec.field(default_factory=StageCost)
    decoder: StageCost = msgspec.field(default_factory=StageCost)
    #: what a request with an input image adds to the encoder: the VAE encoding of the image (time, and its
    #: latents and pixels moved on to the denoiser)
    image: StageCost = msgspec.field(default_factory=StageCost)
    reference_pixels: int = 1024 * 1024
    lora: LoraCost = msgspec.field(default_factory=LoraCost)
    #: video: frames per latent frame (Wan: 4); a request's pixels are then width x height x latent frames,
    #: (frames - 1) // temporal + 1. 0: frames do not count
    temporal: int = 0
    #: another profile (a name in sim_profiles/) whose costs requests with num_frames take: one deployment then
    #: serves images at this profile's costs and videos at that one's
    video: str = ""
    #: (latent) pixels per latent token: the VAE's 8x and the transformer's 2x2 patches (Flux, Wan, Qwen-Image)
    pixels_per_token: int = 256
    #: every simulated stage time (computes, and a replica's copies from host memory; not adapter loads) multiplied
    #: by this: a benchmark that needs many requests of a slow model runs a copy of its profile faster, every ratio
    #: kept
    time_scale: float = 1.0

    def latent_frames(self, frames: int | None) -> int:
        """A video's latent frames, (frames - 1) // temporal + 1; 1 for an image or where frames do not count."""
        return (frames - 1) // self.temporal + 1 if frames and self.temporal else 1

    def for_request(self, p: dict) -> tuple["SimProfile", int]:
        """The profile a request's costs come from, and its size in (latent) pixels."""
        prof = self
        frames = p.get("num_frames")
        if frames and self.video:
            prof = load_profile(self.video)
        return prof, p["width"] * p["height"] * prof.latent_frames(frames)

    def payload(self, role: str, pixels: int, images: int = 1, with_image: bool = False) -> int:
        """Bytes `role` stages; the encoder's include the image's when the launcher sizes pools for it."""
        if role == "encoder" and with_image:
            return self.payload(role, pixels, images) + self.payload("image", pixels)
        cost = getattr(self, role)
        if not cost.payload_bytes:
            return 0
        n = cost.payload_bytes * (pixels / self.reference_pixels if cost.payload_scales else 1)
        per = max(64, int(n) // 64 * 64)
        return per * (images if role == "denoiser" else 1)

    def weights(self, role: str) -> int:
        """Bytes of weights `role` holds on its device (a colocated instance, "monolith": every stage's)."""
        if role == "monolith":
            return sum(self.weights(r) for r in ("encoder", "denoiser", "decoder"))
        return getattr(self, role).weights_bytes

    def activations(self, role: str, pixels: int, batch: int = 1) -> int:
        """Peak bytes of `role`'s activations for `batch` requests of `pixels` (latent) pixels each."""
        if role == "monolith":
            return max(self.activations(r, pixels, batch) for r in ("encoder", "denoiser", "decoder"))
        cost = getattr(self, role)
        return int(batch * (cost.activation_bytes + cost.activation_bytes_per_token * pixels / self.pixels_per_token))

    def streamed(self, memory: int, pixels: int, batch: int = 1) -> dict[str, int]:
        """A colocated replica on a device of `memory` bytes: the components it cannot keep there, streamed in from
        host memory for every request (stage -> bytes). It keeps the largest that fit beside the activations of
        `batch` requests of `pixels`, the denoiser first; {} when everything fits."""
        room, out = memory - self.activations("monolith", pixels, batch), {}
        for role in sorted(("encoder", "denoiser", "decoder"), key=lambda r: -self.weights(r)):
            w = self.weights(role)
            if w <= room:
                room -= w
            elif w:
                out[role] = w
        return out

    def stage_ms(self, role: str, pixels: int, steps: int) -> float:
        """Unbatched time of one request in `role` (the unloaded-latency figure benches use)."""
        cost = getattr(self, role)
        return cost.fixed_ms(pixels) + (steps * cost.step_ms(pixels) if role == "denoiser" else 0.0)


def profile_path(name: str) -> Path:
    """sim:NAME is disagg/roles/pipelines/sim_profiles/NAME.yaml; sim:PATH.yaml (any path ending in .yaml) is that file."""
    return Path(name).expanduser() if name.endswith((".yaml", ".yml")) else PROFILE_DIR / f"{name}.yaml"


@functools.cache
def load_profile(name: str) -> SimProfile:
    path = profile_path(name)
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILE_DIR.glob("*.yaml")))
        raise ValueError(f"no simulation profile {name!r} (looked for {path}; known: {known})")
    return msgspec.convert(yaml.safe_load(path.read_text()) or {}, SimProfile)
