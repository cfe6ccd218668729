"""The standard mixed workload of the scheduling issue, as a `disagg bench --trace` file (JSON Lines).

Poisson arrivals at --rate requests per second; each request is drawn 50/40/10 from:
    small  512x512, 4 steps             (a distilled model's quick image)
    large  1024x1024, 28 steps          (a full-quality image)
    video  832x480 (480p), 33 frames, 30 steps
Lines carry no slo_ms: `disagg bench --trace` then gives each --slo-factor x its class's standalone latency.

    python benchmarks/traces/mixed.py --rate 1.2 --num 200 --seed 0 > trace.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys

CLASSES = (
    ("small", 0.5, {"width": 512, "height": 512, "num_inference_steps": 4}),
    ("large", 0.4, {"width": 1024, "height": 1024, "num_inference_steps": 28}),
    ("video", 0.1, {"width": 832, "height": 480, "num_frames": 33, "num_inference_steps": 30}),
)


def generate(rate: float, num: int, seed: int = 0, mix=CLASSES) -> list[dict]:
    rng = random.Random(seed)
    t, lines = 0.0, []
    for _ in range(num):
        _, _, fields = rng.choices(mix, weights=[w for _, w, _ in mix])[0]
        lines.append({"t": round(t, 6), **fields})
        t += rng.expovariate(rate)
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, required=True, help="arrivals per second (Poisson)")
    ap.add_argument("--num", type=int, default=200, help="requests")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for line in generate(args.rate, args.num, args.seed):
        sys.stdout.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
