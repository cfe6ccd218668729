"""Stable Diffusion XL (StableDiffusionXLPipeline) split into encoder / denoiser / decoder.

Two CLIP text encoders: their penultimate hidden states side by side, and text_encoder_2's pooled
projection, which the UNet takes with six "time ids" (original size, crop, target size) that the
denoiser derives from height/width. Classifier-free guidance when guidance_scale > 1 (and the UNet
is not guidance-distilled); with no negative prompt, SDXL base's force_zeros_for_empty_prompt makes
the negative embeddings zeros rather than the encoding of "".
"""

from __future__ import annotations

import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from disagg.roles.pipelines.split import CFG_EMBEDS, SplitPipeline


class SDXLAdapter(SplitPipeline):
    """SDXL from a diffusers checkpoint (folder or hub id)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        vae = self.pipe.vae
        if vae is not None and vae.dtype == torch.float16 and vae.config.force_upcast:
            # The pipeline upcasts the VAE to float32 for each decode (fp16 overflows) and back after; holding it
            # in float32 gives the same images without flipping a shared module's dtype per request.
            vae.to(dtype=torch.float32)

    @staticmethod
    def defaults() -> dict:
        # StableDiffusionXLPipeline.__call__'s defaults; 1024 = unet sample_size 128 x vae_scale_factor 8
        return dict(width=1024, height=1024, num_inference_steps=50, guidance_scale=5.0, num_images_per_prompt=1,
                    negative_prompt=None, seed=0)

    def _cfg(self, p: dict) -> bool:
        # StableDiffusionXLPipeline.do_classifier_free_guidance, from the UNet's config (the encoder holds no UNet)
        return p["guidance_scale"] > 1 and self.ck.configs.get("unet", {}).get("time_cond_proj_dim") is None

    def encode(self, p: dict) -> dict[str, torch.Tensor]:
        with torch.inference_mode():
            # one copy per prompt; denoise repeats it for num_images_per_prompt, keeping the transfer small
            out = self.pipe.encode_prompt(
                prompt=p["prompt"], prompt_2=None, device=self.device, num_images_per_prompt=1,
                do_classifier_free_guidance=self._cfg(p), negative_prompt=p.get("negative_prompt"),
            )
        return {name: t for name, t in zip(CFG_EMBEDS, out) if t is not None}

    def decode(self, inputs: dict[str, torch.Tensor], p: dict) -> list[Image.Image]:
        pipe, vae = self.pipe, self.pipe.vae
        # the output_type="pil" tail of StableDiffusionXLPipeline.__call__ (an fp16 VAE was upcast at load)
        with torch.inference_mode():
            latents = inputs["latents"].to(self.device, vae.dtype)
            mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
            if mean is not None and std is not None:
                mean = torch.tensor(mean).view(1, 4, 1, 1).to(latents.device, latents.dtype)
                std = torch.tensor(std).view(1, 4, 1, 1).to(latents.device, latents.dtype)
                latents = latents * std / vae.config.scaling_factor + mean
            else:
                latents = latents / vae.config.scaling_factor
            image = vae.decode(latents, return_dict=False)[0]
            if pipe.watermark is not None:  # set when invisible-watermark is installed, as in the full pipeline
                image = pipe.watermark.apply_watermark(image)
            return pipe.image_processor.postprocess(image, output_type="pil")

    def fix_without_vae(self, spatial: int, temporal: int) -> None:
        # The pipeline assumes 8 without a VAE; it sizes the latents with it (default_sample_size comes from the UNet).
        self.pipe.vae_scale_factor = spatial
        self.pipe.image_processor = VaeImageProcessor(vae_scale_factor=spatial)
