"""The production day's request lists (sim and demo), its ports and the demo's adapters (benchmarks/chaos_day.py)."""

from __future__ import annotations

import random
import shutil
import socket
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from disagg.roles.compute import preview_steps  # noqa: E402

ROLES = ("encoder", "denoiser", "decoder")
#: the sim part's simulated devices (one instance each) and its launch
SIM_DEVICES = 7
SIM_LORA = "lora: {load_ms: 300, slots: 2, host_slots: 4, restore_ms: 30}\n"
SIM_ADAPTERS = ("ink-a", "ink-b", "ink-c", "ink-d", "ink-e", "ink-f")
DEMO_ADAPTERS = (("inkA", 1, 50.0), ("inkB", 2, 50.0), ("inkC", 3, 30.0))
#: step caches the demo model takes (docs/guide/step-caches.md: the thresholds the tests document for 8 steps)
DEMO_CACHES = ({"type": "first_block", "threshold": 0.3}, {"type": "mag"},
               {"type": "taylorseer", "cache_interval": 2, "disable_cache_before_step": 1}, {"type": "faster"},
               {"type": "pyramid_attention_broadcast", "spatial_attention_block_skip_range": 2}, {"type": "none"})


# --- ports --------------------------------------------------------------------------------------------------------

def _free(port: int) -> bool:
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def pick_ports(lo: int, hi: int, rng: random.Random) -> tuple[int, int]:
    """(P, H) in [lo, hi]: P and P+1 free for the orchestrator, H free for the gateway, H not P or P+1."""
    for _ in range(200):
        port = rng.randrange(lo, hi - 1)
        if _free(port) and _free(port + 1):
            http = [h for h in range(lo, hi + 1) if h not in (port, port + 1) and _free(h)]
            if http:
                return port, rng.choice(http)
    raise SystemExit(f"no free ports in {lo}-{hi}")


# --- the request lists ---------------------------------------------------------------------------------------------

def _schedule(rng: random.Random, standalone_s: float) -> dict:
    """Priorities and deadlines: 30% a priority and a deadline of 3-12x its standalone time, 20% a priority only."""
    r = rng.random()
    if r < 0.3:
        return {"priority": rng.choice([0, 1, 2, 5]), "slo_ms": round(standalone_s * rng.choice([3, 6, 12]) * 1000)}
    if r < 0.5:
        return {"priority": rng.choice([-1, 3])}
    return {}


def _adapters(rng: random.Random, names) -> dict:
    r = rng.random()
    if r < 0.5:
        return {}
    n = 1 if r < 0.85 else 2
    return {"loras": [{"name": name, "scale": rng.choice([1.0, 0.5, 0.8])} for name in rng.sample(list(names), n)]}


def _path(rng: random.Random) -> str:
    r = rng.random()
    return "zmq" if r < 0.6 else "http" if r < 0.8 else "stream"


def _previews(rng: random.Random, path: str) -> dict:
    if path == "stream":
        return {"previews": rng.choice([1, 2, 3])}
    if path == "zmq" and rng.random() < 0.4:
        return {"previews": rng.choice([1, 2, 3])}
    return {}


def sim_trace(seed: int, short: bool) -> list[dict]:
    """Phases that want different splits of the 7 devices: images of 512² x 4 and 1024² x 28 steps (denoisers:
    1:5:1), then 1024² x 1 step (decoders: 1:4:2), and back. --short: 1-step first (a move at once), large
    images of 8 steps, 24 s."""
    rng = random.Random(seed)
    large = 8 if short else 28
    mixed = (((512, 4), 0.7), ((1024, large), 0.3))
    quick = (((1024, 1), 1.0),)
    phases = [(0, 8, 3.0, quick), (8, 24, 2.0, mixed)] if short else [
        (0, 40, 1.5, mixed), (40, 70, 3.0, quick), (70, 110, 1.5, mixed), (110, 140, 3.0, quick), (140, 200, 1.5, mixed)]
    prompts = [f"a production day prompt {k}" for k in range(8)]  # few: repeats hit the conditioning cache
    specs, t = [], 0.0
    for start, end, rate, mix in phases:
        t = max(t, start)
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                break
            (size, steps), = rng.choices([m for m, _ in mix], weights=[w for _, w in mix])
            path = _path(rng)
            standalone = 0.03 + steps * (0.058 + 0.000106812 * size * size / 1000) + 0.085 * size * size / 2**20
            params = {"prompt": rng.choice(prompts), "width": size, "height": size, "num_inference_steps": steps,
                      "seed": rng.randrange(2**31), **_adapters(rng, SIM_ADAPTERS), **_schedule(rng, standalone),
                      **_previews(rng, path)}
            specs.append({"id": f"s{len(specs):04d}", "t": round(t, 3), "path": path, "params": params})
    return specs


def demo_trace(seed: int, short: bool) -> list[dict]:
    """The demo model's own prompts (12 of them: repeats), adapters, step caches, previews, deadlines."""
    from disagg.roles.pipelines.demo import COLOURS, POSITIONS, SHAPES, caption

    rng = random.Random(seed)
    prompts = [caption(rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(POSITIONS)) for _ in range(12)]
    duration, rate = (25, 3.0) if short else (90, 3.0)
    specs, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        path = _path(rng)
        params = {"prompt": rng.choice(prompts), "seed": rng.randrange(2**31), **_adapters(rng, [n for n, *_ in DEMO_ADAPTERS]),
                  **_schedule(rng, 0.5), **_previews(rng, path)}
        if rng.random() < 0.5:
            params["cache"] = rng.choice(DEMO_CACHES)
        specs.append({"id": f"d{len(specs):04d}", "t": round(t, 3), "path": path, "params": params})
    return specs


def previews_asked(params: dict) -> int:
    """Previews a request can get: evenly spaced steps, never the last (disagg/roles/compute.py)."""
    steps = params.get("num_inference_steps") or 8
    return len(preview_steps(steps, params.get("previews") or 0))


# --- the demo's adapters -------------------------------------------------------------------------------------------

def make_demo_loras(folder: Path) -> Path:
    """Three peft adapters on the demo transformer (random, nonzero: each visibly changes the image), as
    /work/shared/notes/combo-2026-12-04/mklora.py and tests/loras.py make them: FOLDER/NAME.safetensors."""
    import torch
    from diffusers import FluxPipeline
    from peft import LoraConfig, get_peft_model_state_dict

    from disagg.roles.pipelines.demo import build_demo_component

    folder.mkdir(parents=True, exist_ok=True)
    for name, seed, mul in DEMO_ADAPTERS:
        if (folder / f"{name}.safetensors").exists():
            continue
        module = build_demo_component("transformer")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                          init_lora_weights=False))
            layers = get_peft_model_state_dict(module)
        for key, value in layers.items():
            if "lora_B" in key:
                value.mul_(mul)
        with tempfile.TemporaryDirectory() as tmp:
            FluxPipeline.save_lora_weights(tmp, transformer_lora_layers=layers)
            shutil.copy(Path(tmp) / "pytorch_lora_weights.safetensors", folder / f"{name}.safetensors")
    return folder
