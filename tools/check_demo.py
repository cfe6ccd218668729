"""Does the demo Flux model draw what the prompt says? Colour and position accuracy through the real FluxPipeline.

    python tools/check_demo.py [--weights DIR] [--seeds 16] [--steps 8] [--size 64] [--contact contact.png]

For every colour x position, `--seeds` seeds (0, 1, ...; shape = SHAPES[seed % 3]) are drawn with the prompt
demo.caption(colour, shape, position). Each picture is measured (measure()):
  - foreground: pixels nearer to a palette colour than to the background (RGB distance);
  - colour: the palette colour most foreground pixels are nearest to; right if it is the named one;
  - position: the foreground's centroid x / width; right if < LEFT_MAX (left), > RIGHT_MIN (right),
    within CENTER (center). The training pictures put the shape's centre at 0.25 / 0.5 / 0.75 (+-0.04);
  - a picture with under MIN_FOREGROUND of its pixels in the foreground is wrong on both counts.
Exits 1 if any colour or position is under --target (default 0.9).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).absolute().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from PIL import Image, ImageDraw

from disagg.roles.pipelines.demo import (
    BACKGROUND,
    COLOURS,
    DEFAULTS,
    POSITIONS,
    SHAPES,
    build_demo_flux_pipeline,
    caption,
)

LEFT_MAX, RIGHT_MIN, CENTER = 0.4, 0.6, (0.35, 0.65)
MIN_FOREGROUND = 0.01


def measure(image: Image.Image) -> dict:
    """Foreground fraction, dominant palette colour and centroid (fractions of width / height) of one picture."""
    px = np.asarray(image.convert("RGB"), dtype=np.float32)
    names = list(COLOURS)
    ref = np.array([BACKGROUND, *(COLOURS[n] for n in names)], dtype=np.float32)
    nearest = np.linalg.norm(px[:, :, None, :] - ref[None, None], axis=-1).argmin(-1)  # 0 = background
    fg = nearest > 0
    out = {"foreground": float(fg.mean()), "got_colour": None, "x": None, "y": None}
    if fg.sum() == 0:
        return out
    counts = np.bincount(nearest[fg], minlength=len(ref))[1:]
    ys, xs = np.nonzero(fg)
    h, w = fg.shape
    out.update(got_colour=names[int(counts.argmax())], colour_share=float(counts.max() / fg.sum()),
               x=float((xs.mean() + 0.5) / w), y=float((ys.mean() + 0.5) / h), shape=guess_shape(fg))
    return out


def guess_shape(fg: np.ndarray) -> str:
    """Informational only: how much of its bounding box the foreground fills (square 1, circle pi/4, triangle 1/2)."""
    ys, xs = np.nonzero(fg)
    fill = fg.sum() / ((xs.max() - xs.min() + 1) * (ys.max() - ys.min() + 1))
    return "square" if fill > 0.88 else "circle" if fill > 0.66 else "triangle"


def position_ok(position: str, x: float | None) -> bool:
    if x is None:
        return False
    if position == "left":
        return x < LEFT_MAX
    if position == "right":
        return x > RIGHT_MIN
    return CENTER[0] <= x <= CENTER[1]


def generate(pipe, prompts, seeds, steps, size):
    return pipe(prompt=list(prompts), height=size, width=size, num_inference_steps=steps,
                generator=[torch.Generator("cpu").manual_seed(s) for s in seeds]).images


def evaluate(pipe, seeds: int = 16, steps: int = DEFAULTS["num_inference_steps"], size: int = DEFAULTS["height"]):
    """Every colour x position x seed: returns (rows, seconds per image); each row is one picture's verdict."""
    rows, t0 = [], time.time()
    for colour in COLOURS:
        for position in POSITIONS:
            keys = [(colour, SHAPES[s % len(SHAPES)], position, s) for s in range(seeds)]
            images = generate(pipe, [caption(*k[:3]) for k in keys], [k[3] for k in keys], steps, size)
            rows += [verdict(*k, img) for k, img in zip(keys, images)]
    return rows, (time.time() - t0) / len(rows)


def verdict(colour: str, shape: str, position: str, seed: int, image: Image.Image) -> dict:
    """One picture drawn for caption(colour, shape, position): what measure() sees, and whether it is right."""
    m = measure(image)
    enough = m["foreground"] >= MIN_FOREGROUND
    m["got_shape"] = m.pop("shape", None)
    return dict(colour=colour, shape=shape, position=position, seed=seed, image=image, **m,
                colour_ok=enough and m["got_colour"] == colour, position_ok=enough and position_ok(position, m["x"]))


def table(rows) -> tuple[str, float]:
    """A text table of accuracies by colour and by position, and the worst of them."""
    lines = [f"{'':10s} {'n':>4s} {'colour':>7s} {'position':>9s} {'both':>6s}"]
    worst = 1.0
    for field, values in (("colour", COLOURS), ("position", POSITIONS)):
        for v in values:
            sel = [r for r in rows if r[field] == v]
            acc = {k: np.mean([r[k] for r in sel]) for k in ("colour_ok", "position_ok")}
            both = np.mean([r["colour_ok"] and r["position_ok"] for r in sel])
            worst = min(worst, acc["colour_ok"], acc["position_ok"])
            lines.append(f"{v:10s} {len(sel):4d} {acc['colour_ok']:7.1%} {acc['position_ok']:9.1%} {both:6.1%}")
    both = np.mean([r["colour_ok"] and r["position_ok"] for r in rows])
    shape_acc = np.mean([r["got_shape"] == r["shape"] for r in rows])
    lines.append(f"{'all':10s} {len(rows):4d} {np.mean([r['colour_ok'] for r in rows]):7.1%} "
                 f"{np.mean([r['position_ok'] for r in rows]):9.1%} {both:6.1%}")
    lines.append(f"(shape, informational, from how much of its bounding box the foreground fills: {shape_acc:.1%})")
    return "\n".join(lines), worst


def sheet(images, labels, cols, scale=3) -> Image.Image:
    """A grid of pictures (enlarged `scale` times, nearest-neighbour) with a caption under each."""
    w, h = images[0].width * scale, images[0].height * scale
    label_h = 14
    rows = (len(images) + cols - 1) // cols
    out = Image.new("RGB", (cols * (w + 8) + 8, rows * (h + label_h + 8) + 8), (200, 200, 200))
    d = ImageDraw.Draw(out)
    for i, (img, text) in enumerate(zip(images, labels)):
        x, y = 8 + (i % cols) * (w + 8), 8 + (i // cols) * (h + label_h + 8)
        out.paste(img.resize((w, h), Image.NEAREST), (x, y))
        d.text((x, y + h + 2), text, fill=(0, 0, 0))
    return out


EXAMPLES = ROOT / "examples" / "prompts.json"  # the README's first command draws these: the contact sheet shows them


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", type=Path, default=None, help="default: disagg/roles/pipelines/demo/")
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--steps", type=int, default=DEFAULTS["num_inference_steps"])
    ap.add_argument("--size", type=int, default=DEFAULTS["height"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--contact", type=Path, default=None, help="write a contact sheet of examples/prompts.json here")
    ap.add_argument("--failures", type=Path, default=None, help="write a sheet of the pictures that failed here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pipe = build_demo_flux_pipeline(weights_dir=args.weights)

    if args.contact:
        import json

        examples = json.loads(EXAMPLES.read_text())
        images = generate(pipe, [e["prompt"] for e in examples], [e["seed"] for e in examples], args.steps, args.size)
        sheet(images, [e["prompt"][2:].replace(" the ", " ") for e in examples], cols=4).save(args.contact)
        print(f"wrote {args.contact}")

    rows, per_image = evaluate(pipe, args.seeds, args.steps, args.size)
    text, worst = table(rows)
    print(f"{args.size}x{args.size}, {args.steps} steps, {per_image * 1000:.0f} ms/image (batches of {args.seeds}, "
          f"{torch.get_num_threads()} threads); thresholds: left x<{LEFT_MAX}, right x>{RIGHT_MIN}, "
          f"center {CENTER[0]}<=x<={CENTER[1]}, foreground >= {MIN_FOREGROUND:.0%}")
    print(text)
    bad = [r for r in rows if not (r["colour_ok"] and r["position_ok"])]
    for r in bad:
        print(f"  FAIL seed {r['seed']:2d} '{caption(r['colour'], r['shape'], r['position'])}': got {r['got_colour']} "
              f"x={r['x'] if r['x'] is None else round(r['x'], 2)} fg={r['foreground']:.2f}")
    if args.failures and bad:
        sheet([r["image"] for r in bad], [f"{r['colour'][0]}{r['shape'][0]}{r['position'][0]} s{r['seed']}" for r in bad],
              cols=8).save(args.failures)
    print(f"worst colour/position accuracy {worst:.1%} (target {args.target:.0%})")
    sys.exit(0 if worst >= args.target else 1)


if __name__ == "__main__":
    main()
