"""Flux.1 (dev: guidance-distilled; schnell: no guidance embedding) split into encoder / denoiser / decoder.

Flux has no classifier-free guidance: dev takes `guidance_scale` as an input of the transformer,
schnell ignores it, and a negative prompt has no effect (diffusers applies one only with
true_cfg_scale > 1, which requests do not set).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps
from PIL import Image

from disagg.roles.pipelines.adapter import Capabilities, LoraSupport
from disagg.roles.pipelines.conditioned import out_size
from disagg.roles.pipelines.split import SplitPipeline, repeat_rows, step_callback

T5_MAX_LENGTH = 512  # FluxPipeline's default max_sequence_length


class FluxSplit:
    """Encode / denoise / decode on `self.pipe`, a FluxPipeline holding one role's components."""

    pipe = None
    device = "cpu"
    #: the built-in Flux models (tiny, demo): a FluxPipeline, batched steps, previews from each step's latents
    capabilities = Capabilities(batching=True, previews=True, loras=LoraSupport.DIFFUSERS, family="flux")

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
            height, width = out_size(inputs, p)
            latents = pipe._unpack_latents(inputs["latents"].to(self.device), height, width, pipe.vae_scale_factor)
            latents = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
            image = pipe.vae.decode(latents.to(pipe.vae.dtype), return_dict=False)[0]
            return pipe.image_processor.postprocess(image, output_type="pil")

    @staticmethod
    def generator(p: dict) -> torch.Generator:
        return torch.Generator("cpu").manual_seed(p["seed"])

    # --- step-level batching (disagg/roles/batcher.py): FluxPipeline.__call__'s loop, one step at a time,
    # with each request's own latents, schedule and guidance, and one transformer forward per step ---

    @staticmethod
    def batch_key(p: dict):
        return (p["width"], p["height"])

    def denoise_start(self, inputs: dict[str, torch.Tensor], p: dict) -> "FluxState":
        pipe, n, steps = self.pipe, p["num_images_per_prompt"], p["num_inference_steps"]
        embeds = repeat_rows(inputs["prompt_embeds"], n, self.device)
        pooled = repeat_rows(inputs["pooled_prompt_embeds"], n, self.device)
        with torch.inference_mode():
            latents, image_ids = pipe.prepare_latents(n, pipe.transformer.config.in_channels // 4, p["height"],
                                                      p["width"], embeds.dtype, self.device, self.generator(p), None)
            scheduler = copy.deepcopy(pipe.scheduler)  # its step index is this request's own
            sigmas = None if scheduler.config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
            mu = calculate_shift(latents.shape[1], scheduler.config.get("base_image_seq_len", 256),
                                 scheduler.config.get("max_image_seq_len", 4096), scheduler.config.get("base_shift", 0.5),
                                 scheduler.config.get("max_shift", 1.15))
            timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)
            scheduler.set_begin_index(0)
        guidance = (torch.full([n], p["guidance_scale"], device=self.device, dtype=torch.float32)
                    if pipe.transformer.config.guidance_embeds else None)
        return FluxState(latents, image_ids, embeds, pooled, guidance, scheduler, timesteps)

    def denoise_steps(self, states: list["FluxState"]) -> None:
        pipe = self.pipe
        first = states[0]
        with torch.inference_mode():
            latents = torch.cat([s.latents for s in states])
            timestep = torch.cat([s.timesteps[s.i].expand(s.latents.shape[0]) for s in states]).to(latents.dtype)
            embeds = torch.cat([s.embeds for s in states])
            text_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=embeds.dtype)
            with pipe.transformer.cache_context("cond"):
                noise = pipe.transformer(
                    hidden_states=latents, timestep=timestep / 1000,
                    guidance=torch.cat([s.guidance for s in states]) if first.guidance is not None else None,
                    pooled_projections=torch.cat([s.pooled for s in states]), encoder_hidden_states=embeds,
                    txt_ids=text_ids, img_ids=first.image_ids, joint_attention_kwargs={}, return_dict=False,
                )[0]
            for s, part in zip(states, noise.split([s.latents.shape[0] for s in states])):
                s.latents = s.scheduler.step(part, s.timesteps[s.i], s.latents, return_dict=False)[0]
                s.i += 1

    def denoise_result(self, state: "FluxState") -> dict[str, torch.Tensor]:
        return {"latents": state.latents}


class FluxState:
    """One request inside a batched Flux denoising loop."""

    def __init__(self, latents, image_ids, embeds, pooled, guidance, scheduler, timesteps):
        self.latents, self.image_ids, self.embeds, self.pooled = latents, image_ids, embeds, pooled
        self.guidance, self.scheduler, self.timesteps = guidance, scheduler, timesteps
        self.i = 0

    @property
    def done(self) -> bool:
        return self.i >= len(self.timesteps)


class FluxAdapter(FluxSplit, SplitPipeline):
    """Flux from a diffusers checkpoint (folder or hub id)."""

    family_capabilities = {"batching": True}

    def fix_without_vae(self, spatial: int, temporal: int) -> None:
        # FluxPipeline assumes 8 without a VAE; latents are packed 2x2, hence the image processor's x2
        self.pipe.vae_scale_factor = spatial
        self.pipe.image_processor = VaeImageProcessor(vae_scale_factor=spatial * 2)
