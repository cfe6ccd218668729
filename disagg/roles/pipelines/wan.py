"""Wan 2.1 / 2.2 text-to-video (diffusers WanPipeline) split into encoder / denoiser / decoder.

encoder:  UMT5 text encoder + tokenizer -> prompt_embeds (+ negative_prompt_embeds when CFG is on)
denoiser: transformer (Wan 2.2 A14B: also transformer_2, switched at boundary_ratio) + scheduler -> latents
decoder:  AutoencoderKLWan -> frames, exactly the non-latent tail of WanPipeline.__call__

Diffusers quirks handled here:
* WanTransformer3DModel declares `_keep_in_fp32_modules`; diffusers loads such a model only with
  accelerate installed (a dependency of ours for this reason).
* Without a VAE, WanPipeline assumes 8x spatial / 4x temporal downsampling; `fix_without_vae` sets the
  checkpoint's own factors (checkpoint.vae_scale_factors: the VAE config's `scale_factor_*` when present,
  e.g. 16x for Wan 2.2 TI2V-5B).
* The pipeline encodes with max_sequence_length=512 (encode_prompt's own default is 226).
"""

from __future__ import annotations

import contextlib
import copy
import threading

import torch
from diffusers.video_processor import VideoProcessor
from PIL import Image

from disagg.roles.pipelines.split import SplitPipeline, repeat_rows, step_callback

MAX_SEQUENCE_LENGTH = 512  # WanPipeline.__call__'s default (encode_prompt alone would use 226)


class WanAdapter(SplitPipeline):
    """Wan 2.1 / 2.2 text-to-video from a diffusers checkpoint (folder or hub id)."""

    #: the decoder makes videos: one list of PIL frames per video, encoded as MP4
    video = True
    #: decode(progress=) hands the device over between the video's latent frames (schedule slo)
    family_capabilities = {"decode_yields": True}

    @staticmethod
    def defaults() -> dict:
        # WanPipeline.__call__'s defaults (480x832, 81 frames, 50 steps, guidance 5.0); 16 fps is Wan 2.1's
        # frame rate (diffusers' examples export_to_video(..., fps=16))
        return dict(width=832, height=480, num_frames=81, num_inference_steps=50, guidance_scale=5.0,
                    num_images_per_prompt=1, negative_prompt=None, seed=0, fps=16)

    @staticmethod
    def cfg(p: dict) -> bool:
        """Classifier-free guidance on: WanPipeline.do_classifier_free_guidance (guidance_scale > 1)."""
        return p["guidance_scale"] > 1.0

    def encode(self, p: dict) -> dict[str, torch.Tensor]:
        with torch.inference_mode():
            # one copy per prompt; denoise repeats it for the videos per prompt, keeping the transfer small
            embeds, negative = self.pipe.encode_prompt(
                prompt=p["prompt"], negative_prompt=p.get("negative_prompt"),
                do_classifier_free_guidance=self.cfg(p), num_videos_per_prompt=1,
                max_sequence_length=MAX_SEQUENCE_LENGTH, device=self.device,
            )
        out = {"prompt_embeds": embeds}
        if negative is not None:
            out["negative_prompt_embeds"] = negative
        return out

    def denoise(self, inputs: dict[str, torch.Tensor], p: dict, progress=None) -> dict[str, torch.Tensor]:
        pipe = self.pipe
        n = p["num_images_per_prompt"]
        negative = inputs.get("negative_prompt_embeds")
        if self.cfg(p) and negative is None:
            # the pipeline would try to encode "" with the text encoder this process does not hold
            raise ValueError("guidance_scale > 1 needs negative_prompt_embeds from the encoder")
        extra = {}
        if pipe.config.boundary_ratio is not None and p.get("guidance_scale_2") is not None:
            extra["guidance_scale_2"] = p["guidance_scale_2"]  # Wan 2.2: the low-noise stage's scale
        with torch.inference_mode():
            latents = pipe(
                # rows adjacent per prompt, exactly as encode_prompt's repeat + view
                prompt_embeds=repeat_rows(inputs["prompt_embeds"], n, self.device),
                negative_prompt_embeds=repeat_rows(negative, n, self.device) if self.cfg(p) else None,
                height=p["height"], width=p["width"], num_frames=p["num_frames"],
                num_inference_steps=p["num_inference_steps"], guidance_scale=p["guidance_scale"],
                num_videos_per_prompt=1, generator=self.generator(p), output_type="latent",
                callback_on_step_end=step_callback(progress), max_sequence_length=MAX_SEQUENCE_LENGTH, **extra,
            ).frames
        return {"latents": latents}

    def _yielding_vae(self, progress):
        """The VAE for one decode that calls `progress` before each latent frame's decoder forward: a shallow
        copy, so its per-call cache (`_feat_map`, `_conv_idx`, set by clear_cache) is its own while the
        modules are shared, and another decode may run between its frames. The hook sits on the shared
        decoder module once and calls the progress of the thread that runs it."""
        vae = self.pipe.vae
        if getattr(self, "_frame_hook", None) is None:
            self._frame_hook = _FrameHook()
            vae.decoder.register_forward_pre_hook(self._frame_hook)
        own = copy.copy(vae)
        own.clear_cache()
        return own, self._frame_hook.calling(progress)

    def decode(self, inputs: dict[str, torch.Tensor], p: dict, progress=None) -> list[list[Image.Image]]:
        if progress is None:
            return self._decode(inputs, self.pipe.vae)
        vae, calling = self._yielding_vae(progress)
        with calling:
            return self._decode(inputs, vae)

    def _decode(self, inputs: dict[str, torch.Tensor], vae) -> list[list[Image.Image]]:
        from diffusers.utils.torch_utils import get_module_execution_device

        pipe = self.pipe
        # the output_type != "latent" tail of WanPipeline.__call__, then "pil" frames
        with torch.inference_mode():
            latents = inputs["latents"].to(get_module_execution_device(vae), dtype=vae.dtype)
            z = vae.config.z_dim
            latents_mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
            latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(
                latents.device, latents.dtype)
            latents = latents / latents_std + latents_mean
            video = vae.decode(latents, return_dict=False)[0]
            # "pil": a list (one per video) of lists of PIL frames
            return pipe.video_processor.postprocess_video(video, output_type="pil")

    def fix_without_vae(self, spatial: int, temporal: int) -> None:
        # what WanPipeline.__init__ reads from vae.config (vae_scale_factors prefers its scale_factor_* keys)
        self.pipe.vae_scale_factor_spatial = spatial
        self.pipe.vae_scale_factor_temporal = temporal
        self.pipe.video_processor = VideoProcessor(vae_scale_factor=spatial)


class _FrameHook:
    """A forward pre-hook on a 3D VAE's decoder: the calling thread's progress, before every latent frame after
    its first (the first frame starts the decode, which already holds the device)."""

    def __init__(self):
        self._local = threading.local()

    def __call__(self, _module, _args):
        state = getattr(self._local, "state", None)
        if state is not None:
            if state[1]:
                state[0]()
            state[1] += 1

    @contextlib.contextmanager
    def calling(self, progress):
        """While inside, this thread's decoder forwards call `progress` (from the second on)."""
        self._local.state = [progress, 0]
        try:
            yield
        finally:
            self._local.state = None
