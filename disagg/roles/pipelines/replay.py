"""The two halves' machinery of an image task (conditioned.py): what the encoder records, what the denoiser replays.

Recorder wraps a task pipeline's encoders in the encoder role and keeps each call's output (a VAE's latent
distribution as its moments, not a sample); the outputs travel as named tensors with a JSON layout (LAYOUT).
In the denoiser, `replay` rebuilds them, `replaying` stands in for the encoders, and ReplayVAE for the VAE:
no weights, its real config, `encode` returning the recorded distributions for the pipeline to sample.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from PIL import Image

from disagg.transport.data.manifest import dtype_name

#: recorded and replayed methods of the pipeline (vae.encode is handled by Recorder / ReplayVAE)
METHODS = ("encode_prompt", "encode_image")
#: the tensor naming the layout of the recorded outputs (JSON in uint8)
LAYOUT = "_replay"
#: the denoiser's tensor naming the task pipeline its latents came from (the decoder follows its tail)
TASK = "_task"


class StopBeforeDenoise(Exception):
    """Raised by the encoder's transformer stand-in at the first denoising step."""


def meta_model(cls, config, dtype: torch.dtype) -> torch.nn.Module:
    """The denoising model, built from its config on the meta device: no memory, every attribute."""
    with torch.device("meta"):
        if hasattr(cls, "from_config"):
            model = cls.from_config(config)
        else:
            model = cls._from_config(config)
    if next(model.parameters()).dtype != dtype:
        model = model.to(dtype)

    def stop(*_args, **_kw):
        raise StopBeforeDenoise

    model.register_forward_pre_hook(stop)
    return model


class Recorder:
    """Wraps a pipeline's encoders so each call's output is kept, in call order."""

    def __init__(self, pipe):
        self.calls: dict[str, list] = {}
        for name in METHODS:
            fn = getattr(pipe, name, None)
            if fn is not None:
                setattr(pipe, name, self._wrap(name, fn))
        vae = getattr(pipe, "vae", None)
        if vae is not None:
            self.vae_dtype = dtype_name(vae.dtype)
            vae.encode = self._wrap_vae(vae.encode)

    def _wrap(self, name, fn):
        def recorded(*args, **kw):
            out = fn(*args, **kw)
            self.calls.setdefault(name, []).append(out)
            return out
        return recorded

    def _wrap_vae(self, fn):
        def recorded(x, return_dict=True):
            out = fn(x, return_dict=return_dict)
            dist = out.latent_dist if return_dict else out[0]
            self.calls.setdefault("vae.encode", []).append((dist.parameters, return_dict))
            return out
        return recorded

    def tensors(self, task_class: str) -> dict[str, torch.Tensor]:
        """The recorded outputs as named tensors, with their layout (LAYOUT) to rebuild them."""
        out, layout = {}, {"class": task_class, "calls": {}, "vae_dtype": getattr(self, "vae_dtype", "")}
        for name, calls in self.calls.items():
            shapes = []
            for i, result in enumerate(calls):
                if name == "vae.encode":
                    params, return_dict = result
                    out[f"{name}/{i}/0"] = params.detach().contiguous()
                    shapes.append({"return_dict": return_dict})
                    continue
                items = result if isinstance(result, (tuple, list)) else [result]
                kinds = []
                for j, t in enumerate(items):
                    if t is None:
                        kinds.append(None)
                    elif isinstance(t, torch.Tensor):
                        out[f"{name}/{i}/{j}"] = t.detach().contiguous()
                        kinds.append("t")
                    else:
                        raise TypeError(f"{name} returned a {type(t).__name__}; only tensors can be replayed")
                shapes.append({"items": kinds, "tuple": isinstance(result, (tuple, list))})
            layout["calls"][name] = shapes
        out[LAYOUT] = torch.frombuffer(bytearray(json.dumps(layout).encode()), dtype=torch.uint8)
        return out


def pixels(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image).copy())


class ReplayVAE(torch.nn.Module):
    """The denoiser's VAE: no weights, its real config, and `encode` returning the encoder's recorded
    distributions in call order (the pipeline samples them with its own generator)."""

    def __init__(self, config, device: str, dtype: torch.dtype):
        super().__init__()
        from diffusers.configuration_utils import FrozenDict

        self.config = config if isinstance(config, FrozenDict) else FrozenDict(config)
        self._device, self._dtype = torch.device(device), dtype
        self.recorded: list[tuple[torch.Tensor, bool]] = []

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # what a pipeline reads off the VAE itself (Qwen-Image: temperal_downsample)
            config = self.__dict__.get("config")
            if config is not None and name in config:
                return config[name]
            raise

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def to(self, *args, **kw):  # the pipelines upcast their VAE (SDXL): only the dtype it reports changes
        dtype = kw.get("dtype") or next((a for a in args if isinstance(a, torch.dtype)), None)
        if dtype is not None:
            self._dtype = dtype
        return self

    def encode(self, x, return_dict: bool = True):
        from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKLOutput
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        if not self.recorded:
            raise RuntimeError("the pipeline encoded more images than the encoder role did")
        params, _ = self.recorded.pop(0)
        dist = DiagonalGaussianDistribution(params.to(self._device))
        return AutoencoderKLOutput(latent_dist=dist) if return_dict else (dist,)


def replay(inputs: dict[str, torch.Tensor], device: str) -> tuple[dict, dict[str, list]]:
    """The layout, and per method the recorded results rebuilt, on `device`."""
    layout = json.loads(bytes(inputs[LAYOUT].cpu().numpy()).decode())
    calls: dict[str, list] = {}
    for name, shapes in layout["calls"].items():
        results = []
        for i, shape in enumerate(shapes):
            if name == "vae.encode":
                results.append((inputs[f"{name}/{i}/0"], shape["return_dict"]))
                continue
            items = [None if k is None else inputs[f"{name}/{i}/{j}"].to(device) for j, k in enumerate(shape["items"])]
            results.append(tuple(items) if shape["tuple"] else items[0])
        calls[name] = results
    return layout, calls


def replaying(name: str, results: list):
    def replayed(*_args, **_kw):
        if not results:
            raise RuntimeError(f"the pipeline called {name} more often than in the encoder role")
        return results.pop(0)
    return replayed


def unpixel(t: torch.Tensor | None, mode: str) -> Image.Image | None:
    return None if t is None else Image.fromarray(t.cpu().numpy(), mode=mode)


def name_tensor(name: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(name.encode()), dtype=torch.uint8)


def task_class(inputs: dict[str, torch.Tensor]) -> str:
    """The task pipeline class that made the decoder's latents ('' for the family's own text path)."""
    t = inputs.get(TASK)
    return bytes(t.cpu().numpy()).decode() if t is not None else ""
