"""Flux.1 (dev: guidance-distilled; schnell: no guidance embedding) split into encoder / denoiser / decoder.

Flux has no classifier-free guidance: dev takes `guidance_scale` as an input of the transformer,
schnell ignores it, and a negative prompt has no effect (diffusers applies one only with
true_cfg_scale > 1, which requests do not set).
"""

from __future__ import annotations

import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from roles.pipelines.split import SplitPipeline, repeat_rows, step_callback

T5_MAX_LENGTH = 512  # FluxPipeline's default max_sequence_length


class FluxSplit:
    """Encode / denoise / decode on `self.pipe`, a FluxPipeline holding one role's components."""

    pipe = None
    device = "cpu"

    @staticmethod
    def defaults() -> dict:
        # FluxPipeline.__call__'s defaults, except 4 steps and 1024^2 (FLUX's native size) to stay cheap
        return dict(width=1024, height=1024, num_inference_steps=28, guidance_scale=3.5, num_images_per_prompt=1,
                    negative_prompt=None, seed=0)

    def encode(self, p: dict) -> dict[str, torch.Tensor]:
        with torch.inference_mode():
            # one copy per prompt; denoise repeats it for num_images_per_prompt, keeping the transfer small
            embeds, pooled, _ = self.pipe.encode_prompt(
                prompt=p["prompt"], prompt_2=None, device=self.device, num_images_per_prompt=1,
                max_sequence_length=T5_MAX_LENGTH,
            )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def denoise(self, inputs: dict[str, torch.Tensor], p: dict, progress=None) -> dict[str, torch.Tensor]:
        n = p["num_images_per_prompt"]
        with torch.inference_mode():
            latents = self.pipe(
                # batch-1 embeds would broadcast in the transformer (not bit-exact): expand as encode_prompt does
                prompt_embeds=repeat_rows(inputs["prompt_embeds"], n, self.device),
                pooled_prompt_embeds=repeat_rows(inputs["pooled_prompt_embeds"], n, self.device),
                height=p["height"], width=p["width"], num_inference_steps=p["num_inference_steps"],
                guidance_scale=p["guidance_scale"], num_images_per_prompt=1, generator=self.generator(p),
                output_type="latent", callback_on_step_end=step_callback(progress),
            ).images
        return {"latents": latents}

    def decode(self, inputs: dict[str, torch.Tensor], p: dict) -> list[Image.Image]:
        pipe = self.pipe
        # the output_type="pil" tail of FluxPipeline.__call__
        with torch.inference_mode():
            latents = pipe._unpack_latents(inputs["latents"].to(self.device), p["height"], p["width"],
                                           pipe.vae_scale_factor)
            latents = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
            image = pipe.vae.decode(latents.to(pipe.vae.dtype), return_dict=False)[0]
            return pipe.image_processor.postprocess(image, output_type="pil")

    @staticmethod
    def generator(p: dict) -> torch.Generator:
        return torch.Generator("cpu").manual_seed(p["seed"])


class FluxAdapter(FluxSplit, SplitPipeline):
    """Flux from a diffusers checkpoint (folder or hub id)."""

    def fix_without_vae(self, spatial: int, temporal: int) -> None:
        # FluxPipeline assumes 8 without a VAE; latents are packed 2x2, hence the image processor's x2
        self.pipe.vae_scale_factor = spatial
        self.pipe.image_processor = VaeImageProcessor(vae_scale_factor=spatial * 2)
