"""Stable Diffusion 3 / 3.5 (StableDiffusion3Pipeline) split into encoder / denoiser / decoder.

Three text encoders (CLIP-L, CLIP-G, T5) make one joint sequence (77 CLIP tokens padded to T5's
width, then the T5 tokens) and one pooled vector; classifier-free guidance when guidance_scale > 1,
with the negative prompt ("" when unset) encoded the same way. The VAE decode adds SD3's shift factor.
"""

from __future__ import annotations

import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from disagg.roles.pipelines.checkpoint import vae_scale_factors
from disagg.roles.pipelines.conditioned import task_class
from disagg.roles.pipelines.split import CFG_EMBEDS, SplitPipeline

T5_MAX_LENGTH = 256  # StableDiffusion3Pipeline.__call__'s default max_sequence_length


class SD3Adapter(SplitPipeline):
    """SD3 / SD3.5 from a diffusers checkpoint (folder or hub id)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        transformer = self.pipe.transformer
        if transformer is not None and transformer.dtype != self.dtype:
            # Without `accelerate`, diffusers loads a float32 file into SD3Transformer2DModel by assigning the file's
            # tensors (its first state key, the pos_embed buffer, is float32 in both), ignoring torch_dtype: cast
            # it as the accelerate path would, or bf16 text embeddings meet float32 weights.
            transformer.to(self.dtype)

    def defaults(self) -> dict:
        # StableDiffusion3Pipeline.__call__'s defaults: default_sample_size (the transformer's sample_size) x
        # vae_scale_factor, 128 x 8 = 1024 for SD3; from the config, since a role may hold neither module
        spatial, _ = vae_scale_factors(self.ck)
        size = int(self.ck.configs.get("transformer", {}).get("sample_size") or 128) * spatial
        return dict(width=size, height=size, num_inference_steps=28, guidance_scale=7.0, num_images_per_prompt=1,
                    negative_prompt=None, seed=0)

    def encode(self, p: dict) -> dict[str, torch.Tensor]:
        cfg = p["guidance_scale"] > 1  # StableDiffusion3Pipeline.do_classifier_free_guidance
        with torch.inference_mode():
            # one copy per prompt; denoise repeats it for num_images_per_prompt, keeping the transfer small
            out = self.pipe.encode_prompt(
                prompt=p["prompt"], prompt_2=None, prompt_3=None, device=self.device, num_images_per_prompt=1,
                do_classifier_free_guidance=cfg, negative_prompt=p.get("negative_prompt"),
                max_sequence_length=T5_MAX_LENGTH,
            )
        return {name: t for name, t in zip(CFG_EMBEDS, out) if t is not None}

    def decode(self, inputs: dict[str, torch.Tensor], p: dict) -> list[Image.Image]:
        vae = self.pipe.vae
        # the output_type="pil" tail of StableDiffusion3Pipeline.__call__ (whose latents already have the VAE's dtype)
        with torch.inference_mode():
            latents = inputs["latents"].to(self.device, vae.dtype)
            # StableDiffusion3InpaintPipeline decodes without the shift factor (diffusers 0.42): as it does
            shift = 0.0 if task_class(inputs) == "StableDiffusion3InpaintPipeline" else vae.config.shift_factor
            latents = (latents / vae.config.scaling_factor) + shift
            image = vae.decode(latents, return_dict=False)[0]
            return self.pipe.image_processor.postprocess(image, output_type="pil")

    def fix_without_vae(self, spatial: int, temporal: int) -> None:
        # The pipeline assumes 8 without a VAE; it sizes the latents (and checks height/width) with it.
        self.pipe.vae_scale_factor = spatial
        self.pipe.image_processor = VaeImageProcessor(vae_scale_factor=spatial)
