"""Train the demo Flux model (disagg/roles/pipelines/demo.py): a tiny VAE, then a tiny FluxTransformer2DModel on its latents.

    python tools/train_demo.py [--out DIR] [--seed N] [--minutes M] [--threads T]

Pictures are drawn here (one coloured shape on a white background, 64x64) with captions from demo.caption();
the text encoders are tiny.py's random-weight ones, frozen. The transformer learns flow matching as FluxPipeline
samples it: x_t = (1 - s) x0 + s noise, velocity target noise - x0, the transformer fed s in [0, 1] (the pipeline
passes timestep / 1000), s drawn uniformly then shifted as FlowMatchEulerDiscreteScheduler shifts the 16-token
schedule of a 64x64 picture. Writes DIR/{transformer,vae}.safetensors and DIR/config.json.

The transformer attends to 512 T5 tokens at inference, of which all but the first ~24 are padding whose embeddings
are the same to ~1e-2. Training keeps the first TEXT_KEEP tokens plus the mean of the rest, given an attention bias
of log(count) so that it weighs as the padding does: the same output to ~1e-5 at a tenth of the cost.

Fixed step counts make a run reproducible from --seed (on the same machine and thread count); --minutes only caps
the wall time (a capped run stops early and is no longer the default model).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).absolute().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw

TEXT_KEEP = 32  # T5 tokens kept as they are; the longest caption is 24 (with </s>)


def draw(colour: str, shape: str, position: str, rng: np.random.Generator, size: int = 64) -> Image.Image:
    """One shape, antialiased (drawn 4x larger, then box-filtered down), jittered in place and size."""
    from disagg.roles.pipelines.demo import BACKGROUND, COLOURS, POSITION_X

    ss = 4
    s = size * ss
    img = Image.new("RGB", (s, s), BACKGROUND)
    d = ImageDraw.Draw(img)
    cx = (POSITION_X[position] + rng.uniform(-0.04, 0.04)) * s
    cy = (0.5 + rng.uniform(-0.12, 0.12)) * s
    r = rng.uniform(0.12, 0.17) * s
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        h = 0.886 * r  # same area as the circle
        d.rectangle([cx - h, cy - h, cx + h, cy + h], fill=fill)
    elif shape == "triangle":
        R = 1.3 * r  # pointing up, centroid at (cx, cy)
        d.polygon([(cx + R * math.cos(a), cy - R * math.sin(a)) for a in (math.pi / 2, 7 * math.pi / 6, 11 * math.pi / 6)],
                  fill=fill)
    else:
        raise ValueError(shape)
    return img.resize((size, size), Image.BOX)


def all_captions():
    from disagg.roles.pipelines.demo import COLOURS, POSITIONS, SHAPES, caption

    keys = [(c, s, p) for c in COLOURS for s in SHAPES for p in POSITIONS]
    return keys, [caption(*k) for k in keys]


def batch(keys, rng, n, size=64):
    """n random pictures as a [-1, 1] tensor, and the index of each one's caption."""
    idx = rng.integers(len(keys), size=n)
    arr = np.stack([np.asarray(draw(*keys[i], rng, size)) for i in idx])
    x = torch.from_numpy(arr).permute(0, 3, 1, 2).float() / 127.5 - 1
    return x, torch.from_numpy(idx)


def lr_at(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))


class Clock:
    def __init__(self, minutes):
        self.t0, self.limit = time.time(), minutes * 60

    def over(self):
        return time.time() - self.t0 > self.limit

    def __str__(self):
        return f"{time.time() - self.t0:6.0f}s"


def train_vae(args, keys, rng, clock):
    from diffusers import AutoencoderKL

    from disagg.roles.pipelines.demo import VAE_CONFIG

    torch.manual_seed(args.seed)
    vae = AutoencoderKL(**VAE_CONFIG).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    for step in range(args.vae_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.vae_steps, args.vae_lr, 50)
        x, _ = batch(keys, rng, args.vae_batch)
        post = vae.encode(x).latent_dist
        z = post.mean + post.std * torch.randn(post.mean.shape, generator=gen)
        rec = vae.decode(z).sample
        mse = F.mse_loss(rec, x)
        loss = mse + F.l1_loss(rec, x) * 0.1 + args.kl * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == args.vae_steps - 1:
            print(f"[vae {clock}] step {step:5d} mse {mse.item():.5f} kl {post.kl().mean().item():.1f}", flush=True)
        if clock.over():
            print(f"[vae] --minutes reached at step {step}: stopping early", flush=True)
            break
    return vae.eval().requires_grad_(False)


def encode_pool(vae, keys, rng, n):
    """n fresh pictures through the VAE: posterior means (B, C, h, w) and caption indices."""
    zs, idxs = [], []
    with torch.no_grad():
        for i in range(0, n, 256):
            x, idx = batch(keys, rng, min(256, n - i))
            zs.append(vae.encode(x).latent_dist.mean)
            idxs.append(idx)
    return torch.cat(zs), torch.cat(idxs)


def text_embeddings(captions):
    """tiny.py's frozen encoders, as FluxPipeline.encode_prompt runs them (512 T5 tokens), then compressed."""
    from diffusers import FluxPipeline

    from disagg.roles.pipelines.flux import T5_MAX_LENGTH
    from disagg.roles.pipelines.tiny import build_component

    pipe = FluxPipeline(scheduler=None, vae=None, transformer=None,
                        **{n: build_component(n) for n in ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")})
    with torch.no_grad():
        embeds, pooled, _ = pipe.encode_prompt(prompt=captions, prompt_2=None, device="cpu",
                                               max_sequence_length=T5_MAX_LENGTH)
    assert max(len(pipe.tokenizer_2(c).input_ids) for c in captions) <= TEXT_KEEP
    n_pad = embeds.shape[1] - TEXT_KEEP
    short = torch.cat([embeds[:, :TEXT_KEEP], embeds[:, TEXT_KEEP:].mean(1, keepdim=True)], 1)
    return short, pooled, math.log(n_pad)


def sigma_shift(u, n_tokens, scheduler_config):
    """The scheduler's dynamic (exponential) time shift for an image of n_tokens, applied to u in [0, 1]."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    c = scheduler_config
    mu = calculate_shift(n_tokens, c["base_image_seq_len"], c["max_image_seq_len"], c["base_shift"], c["max_shift"])
    return math.exp(mu) * u / (math.exp(mu) * u + (1 - u))


def train_transformer(args, latents, caps, embeds, pooled, pad_bias, scheduler_config, clock):
    from diffusers import FluxPipeline, FluxTransformer2DModel

    from disagg.roles.pipelines.demo import TRANSFORMER_CONFIG

    n, c, h, w = latents.shape
    packed = FluxPipeline._pack_latents(latents, n, c, h, w)  # (n, h*w/4, 4c), as FluxPipeline.prepare_latents
    img_ids = FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, "cpu", torch.float32)
    txt_ids = torch.zeros(embeds.shape[1], 3)
    mask = torch.zeros(embeds.shape[1] + packed.shape[1])
    mask[embeds.shape[1] - 1] = pad_bias  # the one token standing for all the padding
    torch.manual_seed(args.seed + 1)
    model = FluxTransformer2DModel(**TRANSFORMER_CONFIG).train()
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed + 2)
    running = None
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, 200)
        i = torch.randint(n, (args.batch,), generator=gen)
        x0, cap = packed[i], caps[i]
        noise = torch.randn(x0.shape, generator=gen)
        s = sigma_shift(torch.rand(args.batch, generator=gen), packed.shape[1], scheduler_config)
        xt = (1 - s[:, None, None]) * x0 + s[:, None, None] * noise
        pred = model(hidden_states=xt, timestep=s, encoder_hidden_states=embeds[cap], pooled_projections=pooled[cap],
                     img_ids=img_ids, txt_ids=txt_ids, return_dict=False,
                     joint_attention_kwargs={"attention_mask": mask.expand(args.batch, -1)})[0]
        loss = F.mse_loss(pred, noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm, 1 - decay)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 250 == 0 or step == args.steps - 1:
            print(f"[transformer {clock}] step {step:5d} loss {running:.4f}", flush=True)
        if clock.over():
            print(f"[transformer] --minutes reached at step {step}: stopping early", flush=True)
            break
    return ema


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "roles" / "pipelines" / "demo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=30.0, help="wall-clock cap for the whole run")
    ap.add_argument("--threads", type=int, default=1, help="2 threads are slower on a shared machine")
    ap.add_argument("--vae-steps", type=int, default=600)
    ap.add_argument("--vae-batch", type=int, default=32)
    ap.add_argument("--vae-lr", type=float, default=2e-3)
    ap.add_argument("--kl", type=float, default=1e-6)
    ap.add_argument("--vae-from", type=Path, default=None, help="reuse DIR/vae.safetensors instead of training one")
    ap.add_argument("--pool", type=int, default=8192, help="pictures encoded once for the transformer")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ema", type=float, default=0.999)
    args = ap.parse_args()

    from safetensors.torch import save_file

    from disagg.roles.pipelines.demo import TRANSFORMER_CONFIG, VAE_CONFIG
    from disagg.roles.pipelines.tiny import SCHEDULER_CONFIG

    torch.set_num_threads(args.threads)
    clock = Clock(args.minutes)
    rng = np.random.default_rng(args.seed)
    keys, captions = all_captions()

    if args.vae_from:
        from disagg.roles.pipelines.demo import build_demo_component

        vae = build_demo_component("vae", args.vae_from)
        rng = np.random.default_rng(args.seed + 100)  # the pictures the VAE was not trained on
    else:
        vae = train_vae(args, keys, rng, clock)
    t_vae = time.time() - clock.t0
    z, caps = encode_pool(vae, keys, rng, args.pool)
    shift, scale = z.mean().item(), 1 / z.std().item()  # Flux's convention: (z - shift) * scale
    print(f"[latents {clock}] {tuple(z.shape)} shift_factor {shift:.4f} scaling_factor {scale:.4f}", flush=True)
    embeds, pooled, pad_bias = text_embeddings(captions)
    model = train_transformer(args, (z - shift) * scale, caps, embeds, pooled, pad_bias, SCHEDULER_CONFIG, clock)
    t_all = time.time() - clock.t0

    args.out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(args.out / "transformer.safetensors"))
    save_file({k: v.contiguous() for k, v in vae.state_dict().items()}, str(args.out / "vae.safetensors"))
    config = {
        "transformer": {**TRANSFORMER_CONFIG, "axes_dims_rope": list(TRANSFORMER_CONFIG["axes_dims_rope"])},
        "vae": {**{k: list(v) if isinstance(v, tuple) else v for k, v in VAE_CONFIG.items()},
                "scaling_factor": round(scale, 6), "shift_factor": round(shift, 6)},
        "scheduler": SCHEDULER_CONFIG,
        "training": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"},
                     "vae_seconds": round(t_vae), "total_seconds": round(t_all), "captions": captions},
    }
    (args.out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    print(f"wrote {args.out} ({size / 1e6:.2f} MB of weights) in {t_all:.0f}s", flush=True)


if __name__ == "__main__":
    main()
