"""Qwen-Image (QwenImagePipeline: text-to-image, img2img, inpainting) and Qwen-Image-Edit (QwenImageEditPipeline).

Every Qwen-Image task runs as diffusers' own task pipeline split in two halves (conditioned.py): the encoder
runs the Qwen2.5-VL text encoder (for an edit, also over the input image) and the VAE's encoder, the
denoiser the MMDiT only, and the decoder the tail below. Guidance is real classifier-free guidance,
which diffusers calls `true_cfg_scale`: a request's guidance_scale goes there, and it applies only
with a negative prompt, as in the pipeline.
"""

from __future__ import annotations

import torch
from PIL import Image

from disagg.roles.pipelines.conditioned import out_size
from disagg.roles.pipelines.split import SplitPipeline


class QwenAdapter(SplitPipeline):
    """Qwen-Image / Qwen-Image-Edit from a diffusers checkpoint (folder or hub id)."""

    #: the pipeline's name for a request's guidance_scale
    guidance_kwarg = "true_cfg_scale"

    @staticmethod
    def defaults() -> dict:
        # QwenImagePipeline.__call__'s defaults (1024^2 = default_sample_size 128 x vae_scale_factor 8); an
        # edit without a size takes its image's aspect at about 1024^2, as QwenImageEditPipeline does
        return dict(width=1024, height=1024, num_inference_steps=50, guidance_scale=4.0, num_images_per_prompt=1,
                    negative_prompt=None, seed=0)

    def decode(self, inputs: dict[str, torch.Tensor], p: dict) -> list[Image.Image]:
        pipe, vae = self.pipe, self.pipe.vae
        # the output_type != "latent" tail of QwenImagePipeline.__call__ (QwenImageEditPipeline's is the same)
        with torch.inference_mode():
            height, width = out_size(inputs, p)
            latents = pipe._unpack_latents(inputs["latents"].to(self.device), height, width, pipe.vae_scale_factor)
            latents = latents.to(vae.dtype)
            z = vae.config.z_dim
            mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
            std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
            latents = latents / std + mean
            image = vae.decode(latents, return_dict=False)[0][:, :, 0]
            return pipe.image_processor.postprocess(image, output_type="pil")

    def fix_without_vae(self, spatial: int, temporal: int) -> None:
        from diffusers.image_processor import VaeImageProcessor

        # QwenImagePipeline assumes 8 without a VAE; latents are packed 2x2, hence the image processor's x2
        self.pipe.vae_scale_factor = spatial
        self.pipe.image_processor = VaeImageProcessor(vae_scale_factor=spatial * 2)
