"""A production day: one deployment with everything on, a mixed trace, and SIGKILLs of every process in turn.

    python benchmarks/chaos_day.py                                   # 1 run of both parts
    python benchmarks/chaos_day.py --runs 3 --out benchmarks/results/chaos-day.json
    python benchmarks/chaos_day.py --short --part sim               # one kill of each kind (the test suite's)

Each run has two parts, each a deployment with every feature on that its model has:
- sim: a copy of disagg/roles/pipelines/sim_profiles/mixed-h200.yaml with `lora: {load_ms: 300, slots: 2, host_slots: 4, restore_ms: 30}`,
  `--gpus 0,...,6 -e 2 -d 3 -k 2 --max-batch 4 --rebalance auto --schedule slo --http-port`: 7 simulated devices
  whose split follows the traffic, adapters loaded, offloaded to host memory and restored, batching, priorities
  and deadlines, the conditioning cache (repeated prompts), live previews. The trace alternates phases that want
  different splits (denoiser-heavy images, then 1-step 1024² images that want decoders), so devices move.
  The sim model's payloads are request-specific (disagg/roles/pipelines/sim.py): each image is checked against the
  reference run's, and against the model's own function of the request (`expected_pixels`); previews too.
- demo: the trained demo model 1:2:1 `--lora-dir DIR --lora-host-slots 2 --max-batch 4 --schedule slo --http-port`,
  with three peft adapters made here, step caches of several types, previews, repeated prompts.

Each part sends one request list twice (sim's --short once: the model's function of the request stands for the
reference image): first to a deployment without kills (the reference images), then, with
the same ids, seeds and parameters at the same times, to a fresh one while processes are SIGKILLed in turn:
every role kind (encoder, denoiser, decoder, the HTTP gateway) and the orchestrator, several times, some of the
orchestrator's kills timed while a rebalance move is in progress (status: rebalance.moving non-empty). Clients:
`client.Client` (ZeroMQ, as `disagg submit`, previews through on_partial) and the official `openai` package
against the gateway (plain and `stream=True, partial_images=N`); an HTTP client retries a dropped connection or
a 502/503 under the same X-Request-Id.

It reports per run and part: requests, answered once, lost, duplicated, wrong images (pixels differ from the
reference's: any difference on sim, more than 1/255 on demo), previews asked / delivered / reported skipped or
lost by the orchestrators (`previews_skipped`, `previews_lost` where the orchestrator reports it) / unaccounted
for, kills per role, and after each orchestrator restart whether the deployment converged within --converge-s:
`rebalance.moving` empty, every instance of the launch ready (on sim: each of the 7 devices serves a role) and
`rebalance.current` equal to the split of the ready instances. It prints a markdown table, writes JSON (--out),
and exits 1 on any loss, duplicate, wrong image, unconverged restart, or a kill plan it could not carry out.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from chaos import pct  # noqa: E402
from chaos_day_pass import Deployment, Pass, ready_split, settled_status  # noqa: E402
from chaos_day_trace import demo_trace, make_demo_loras, pick_ports, previews_asked, sim_trace  # noqa: E402

from disagg.roles.compute import preview_steps  # noqa: E402

# --- comparing ---------------------------------------------------------------------------------------------------

def pixels(data: bytes):
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"), dtype=np.int16)


def max_diff(a: bytes, b: bytes) -> int:
    pa, pb = pixels(a), pixels(b)
    return 255 if pa.shape != pb.shape else int(abs(pa - pb).max())


def compare(part: str, specs: list[dict], ref: Pass | None, run: Pass, tolerance: int) -> dict:
    """The kill pass's answers against the reference pass's (and, on sim, against the model's own function: with
    `ref` None, sim's --short, against that alone)."""
    lost, duplicated, wrong, wrong_model, ref_missing, no_cache_info = [], [], [], [], [], []
    diffs = []
    for s in specs:
        got = run.answers.get(s["id"], [])
        if not got:
            lost.append(s["id"])
            continue
        if len(got) > 1:
            duplicated.append(s["id"])
        image = got[0]["images"][0] if got[0]["images"] else b""
        if s["params"].get("cache") and s["params"]["cache"].get("type") != "none":
            info = got[0]["resolved"]
            if info.get("steps_computed") is None and info.get("cache") is None:
                no_cache_info.append(s["id"])
        reference = ref.answers.get(s["id"]) if ref is not None else None
        if ref is None:
            pass  # sim --short: the model's function stands for the run without kills (below)
        elif not reference or not reference[0]["images"]:
            ref_missing.append(s["id"])
        else:
            d = max_diff(image, reference[0]["images"][0]) if image else 255
            diffs.append(d)
            if d > tolerance:
                wrong.append({"id": s["id"], "max_diff": d, "path": s["path"]})
        if part == "sim":
            from disagg.roles.pipelines.sim import expected_pixels, image_checksum

            if not image or image_checksum(image) != expected_pixels(s["params"]).hex():
                wrong_model.append(s["id"])
                if ref is None:
                    wrong.append({"id": s["id"], "max_diff": 255, "path": s["path"]})
                # which image it is instead: the request's own latents after fewer steps (a preview's copy)?
                steps = s["params"].get("num_inference_steps") or 4
                early = [k for k in range(steps) if image and image_checksum(image) == expected_pixels(
                    s["params"], steps_done=k).hex()]
                for w in wrong:
                    if w["id"] == s["id"]:
                        w["is"] = f"its latents after step {early[0]} of {steps}" if early else "not its own"
                        w["previews"] = s["params"].get("previews") or 0
    asked = sum(previews_asked(s["params"]) for s in specs)
    delivered = sum(len(run.partials.get(s["id"], {})) for s in specs)
    wrong_previews = []
    if part == "sim":
        from disagg.roles.pipelines.sim import expected_pixels, image_checksum

        for s in specs:
            at = {index: step for step, index in preview_steps(s["params"].get("num_inference_steps") or 4,
                                                               s["params"].get("previews") or 0).items()}
            for index, (step, data) in run.partials.get(s["id"], {}).items():
                step = step if step is not None else at.get(index)
                if step is None or image_checksum(data) != expected_pixels(s["params"], steps_done=step).hex():
                    wrong_previews.append(f"{s['id']}#{index}")
    missing: Counter = Counter()  # previews asked and not delivered, by how the request went
    for s in specs:
        gap = previews_asked(s["params"]) - len(run.partials.get(s["id"], {}))
        if gap > 0:
            missing[s["path"] + (" (sent again)" if s["id"] in run.retried else "")] += gap
    sent = sum(c["previews_sent"] for c in run.counters.values())
    skipped = sum(c["previews_skipped"] for c in run.counters.values())
    reported_lost = sum(c["previews_lost"] for c in run.counters.values())
    return {
        "requests": len(specs), "answered_once": sum(len(run.answers.get(s["id"], [])) == 1 for s in specs),
        "lost": len(lost), "duplicated": len(duplicated), "wrong_images": len(wrong),
        "wrong_vs_model": len(wrong_model) if part == "sim" else None, "reference_missing": len(ref_missing),
        "max_pixel_diff": max(diffs, default=0), "cache_info_missing": len(no_cache_info),
        "previews": {"asked": asked, "delivered": delivered, "events": run.partial_events, "sent_reported": sent,
                     "skipped_reported": skipped, "lost_reported": reported_lost,
                     "unaccounted": max(0, asked - delivered - skipped - reported_lost),
                     # received twice (the same index again: a preview decoded again after a restart)
                     "duplicates": run.partial_events - delivered,
                     # not delivered, by path: "stream (sent again)" are streams cut by a gateway kill, whose previews
                     # sent meanwhile went with the dead gateway
                     "missing_by_path": dict(missing),
                     "wrong": len(wrong_previews) if part == "sim" else None},
        "http_sent_again": len(run.retried),
        "lost_ids": lost[:20], "lost_errors": sorted({run.errors.get(i, "no answer")[:200] for i in lost})[:10],
        "duplicated_ids": duplicated[:20], "wrong": wrong[:20], "wrong_vs_model_ids": wrong_model[:20],
        "wrong_previews": wrong_previews[:20], "cache_info_missing_ids": no_cache_info[:20],
    }


# --- a run of one part -----------------------------------------------------------------------------------------

def kill_plan(short: bool) -> list[str]:
    """Every role kind and the orchestrator; `orchestrator@move`: while a rebalance move is in progress."""
    if short:
        return ["orchestrator@restarting", "encoder", "denoiser", "decoder", "gateway"]
    return ["orchestrator@move", "encoder", "denoiser", "gateway", "orchestrator@draining", "decoder", "denoiser",
            "orchestrator@restarting", "encoder", "decoder", "gateway", "orchestrator"]


def run_part(part: str, index: int, args, work: Path, loras: Path | None) -> dict:
    seed = args.seed + index
    specs = (sim_trace if part == "sim" else demo_trace)(seed, args.short)
    plan = kill_plan(args.short)
    if part == "demo":  # no rebalance moves on 1:2:1: every orchestrator kill is a plain one
        plan = [k.partition("@")[0] for k in plan]
    report: dict = {"part": part, "run": index + 1, "seed": seed, "plan": plan}
    passes = {}
    # sim --short (the test suite's): the sim model's image is a function of the request (disagg/roles/pipelines/sim.py
    # expected_pixels, checked against its pipeline by tests/test_chaos_day.py), so that function stands for the
    # run without kills and the reference pass is left out
    tags = (("chaos", plan),) if args.short and part == "sim" else (("reference", None), ("chaos", plan))
    for tag, with_plan in tags:
        dep = Deployment(part, work, f"{index + 1}-{tag}", pick_ports(args.port_lo, args.port_hi, random.Random()), loras)
        print(f"  {part} run {index + 1} {tag}: {len(specs)} requests; {' '.join(dep.cmd[3:])}", flush=True)
        try:
            boot = dep.start()
            p = Pass(dep, specs, with_plan, args, random.Random(seed * 7 + 1))
            took = p.run()
            final = settled_status(dep)
        finally:
            clean = dep.stop()
        passes[tag] = p
        lat = list(p.latency.values())
        report[tag] = {"boot_s": round(boot, 1), "took_s": round(took, 1), "stopped_clean": clean,
                       "orchestrators": len(p.counters), "moves_seen": p.moves_seen,
                       "latency_s": {"p50": round(pct(lat, 0.5), 3), "p99": round(pct(lat, 0.99), 3),
                                     "max": round(max(lat, default=0.0), 3)}}
        if final is not None:
            enc = [i for i in final["instances"] if i["role"] == "encoder"]
            den = [i for i in final["instances"] if i["role"] == "denoiser"]
            report[tag]["final"] = {
                "split": ready_split(final)[0], "rebalance": (final.get("rebalance") or {}).get("current"),
                "moves": (final.get("rebalance") or {}).get("moves"),
                "cond_hits": sum(i["conditioning"]["hits"] for i in enc),
                "cond_lookups": sum(i["conditioning"]["lookups"] for i in enc),
                "lora_loads": sum(i["lora"]["loads"] for i in den), "lora_restores": sum(i["lora"]["restores"] for i in den),
                "batch_sizes": dict(sum((Counter({int(k): v for k, v in (i.get("batch_steps") or {}).items()}) for i in den),
                                        Counter())),
            }
        print(f"    {tag}: {took:.1f} s, {sum(1 for s in specs if p.answers.get(s['id']))}/{len(specs)} answered",
              flush=True)
    chaos = passes["chaos"]
    ref = passes.get("reference")
    report.update(compare(part, specs, ref, chaos, 0 if part == "sim" else args.tolerance))
    if ref is not None:  # the reference pass's previews: what skips cost without a kill
        report["reference"]["previews"] = {"delivered": sum(len(v) for v in ref.partials.values()),
                                           "skipped_reported": sum(c["previews_skipped"] for c in ref.counters.values())}
    report["kills"] = chaos.kills
    report["kills_per_role"] = dict(Counter(k["kind"] for k in chaos.kills))
    report["orchestrator_kills"] = report["kills_per_role"].get("orchestrator", 0)
    report["orchestrator_kills_during_move"] = sum(k["during_move"] for k in chaos.kills if k["kind"] == "orchestrator")
    report["restarts"] = chaos.restarts
    report["final"] = {tag: p.final for tag, p in passes.items()}
    report["converged_all"] = all(r["converged"] for r in chaos.restarts) and chaos.final.get("converged", False)
    report["plan_done"] = Counter(k["kind"] for k in chaos.kills) >= Counter(k.partition("@")[0] for k in plan)
    report["events"] = chaos.events
    report["ok"] = (report["lost"] == 0 and report["duplicated"] == 0 and report["wrong_images"] == 0
                    and not report["wrong_vs_model"] and report["reference_missing"] == 0
                    and report["converged_all"] and report["plan_done"])
    return report


ROW = ("| {part} | {run} | {requests} | {answered_once} | {lost} | {duplicated} | {wrong_images} | {wrong_vs_model} | "
       "{cache_info_missing} | "
       "{pv[asked]} / {pv[delivered]} / {pv[skipped_reported]} / {pv[lost_reported]} / {pv[unaccounted]} | {ok_kills} | "
       "{per_role} | {conv} | {took} |")


def table(reports: list[dict]) -> str:
    lines = ["| part | run | requests | answered once | lost | dup | wrong | wrong vs model | cache info missing | "
             "previews asked / delivered / skipped / lost (reported) / unaccounted | orch. kills (in a move) | "
             "kills per role | converged after restarts; at the end | ref / chaos s |", "|" + "---|" * 14]
    for r in reports:
        per = r["kills_per_role"]
        conv = ", ".join(f"{x['after_s']:.0f}s" if x["converged"] else "NO" for x in r["restarts"]) or "-"
        conv += "; end " + ("yes" if r["final"]["chaos"].get("converged") else "NO")
        lines.append(ROW.format(
            **{**r, "wrong_vs_model": "-" if r["wrong_vs_model"] is None else r["wrong_vs_model"]}, pv=r["previews"], ok_kills=f"{r['orchestrator_kills']} ({r['orchestrator_kills_during_move']})",
            per_role=" ".join(f"{k[0]}{per.get(k, 0)}" for k in ("encoder", "denoiser", "decoder", "gateway")),
            conv=conv, took=f"{r['reference']['took_s']:.0f} / {r['chaos']['took_s']:.0f}" if "reference" in r
            else f"- / {r['chaos']['took_s']:.0f}"))
    return "\n".join(lines)


def interrupted(*_) -> None:
    """SIGTERM: as Ctrl-C (a shell's background job ignores SIGINT), so the deployments are stopped."""
    raise KeyboardInterrupt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--part", choices=("sim", "demo", "both"), default="both")
    ap.add_argument("--short", action="store_true", help="one kill of each kind and a 24 s trace (the test suite's)")
    ap.add_argument("--seed", type=int, default=0, help="run i uses seed + i: its request list and kill draws")
    ap.add_argument("--interval", type=float, default=None, help="seconds between kills (default 8; --short 3)")
    ap.add_argument("--first-kill", type=float, default=None, help="seconds into the trace of the first kill "
                    "(default 6; --short 3)")
    ap.add_argument("--move-wait", type=float, default=None, help="the longest an orchestrator@move kill waits for "
                    "a move (default 45: a phase of the sim trace; --short 20)")
    ap.add_argument("--converge-s", type=float, default=None, help="after an orchestrator kill, the bound on "
                    "convergence (default 60; --short 30)")
    ap.add_argument("--request-timeout", type=float, default=240.0, help="a request not answered this long is lost")
    ap.add_argument("--tolerance", type=int, default=1, help="demo: the largest pixel difference from the reference "
                    "image that is not wrong (sim: 0)")
    ap.add_argument("--ports", default="29600-29699", help="the port range deployments take theirs from")
    ap.add_argument("--work", help="folder for run folders and logs (default: a new temporary one)")
    ap.add_argument("--out", help="write every run's report here as JSON")
    ap.add_argument("-v", "--verbose", action="store_true", help="print kills, moves and restarts as they happen")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, interrupted)
    defaults = {"interval": (8, 3), "first_kill": (6, 3), "move_wait": (45, 20), "converge_s": (60, 30)}
    for name, (full, short) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, short if args.short else full)
    args.port_lo, args.port_hi = map(int, args.ports.split("-"))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="disagg-chaos-day-"))
    work.mkdir(parents=True, exist_ok=True)
    parts = ("sim", "demo") if args.part == "both" else (args.part,)
    loras = make_demo_loras(work / "loras") if "demo" in parts else None
    print(f"logs in {work}", flush=True)
    reports = []
    t_start = time.monotonic()
    try:
        for i in range(args.runs):
            for part in parts:
                t0 = time.monotonic()
                r = run_part(part, i, args, work, loras)
                r["wall_s"] = round(time.monotonic() - t0, 1)
                reports.append(r)
                print(table([r]).splitlines()[-1], flush=True)
    except KeyboardInterrupt:
        print("stopped: the deployments of the run in progress were stopped", flush=True)
        return 130
    print()
    print(table(reports))
    bad = [r for r in reports if not r["ok"]]
    for r in bad:
        why = [f"{r[k]} {k}" for k in ("lost", "duplicated", "wrong_images") if r[k]]
        why += [f"{r['wrong_vs_model']} wrong vs the model"] if r.get("wrong_vs_model") else []
        why += [f"{sum(not x['converged'] for x in r['restarts'])} restarts not converged"] if not r["converged_all"] else []
        end = (r.get("final") or {}).get("chaos") or {}
        why += [f"not converged at the end: {end.get('why')}"] if end and not end.get("converged") else []
        why += ["kill plan not carried out"] if not r["plan_done"] else []
        print(f"- {r['part']} run {r['run']}: " + ", ".join(why))
        for x in r["restarts"]:
            if not x["converged"]:
                print(f"    restart at {x['at_s']} s{' (during a move)' if x['during_move'] else ''}: {x['why']}")
        for w in r["wrong"][:5]:
            print(f"    wrong image {w['id']} ({w['path']}): max diff {w['max_diff']}"
                  + (f"; {w['is']} ({w['previews']} previews asked)" if "is" in w else ""))
    print(f"{len(reports) - len(bad)} of {len(reports)} part runs: 0 lost, 0 duplicated, 0 wrong, converged "
          f"({time.monotonic() - t_start:.0f} s)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "runs": reports},
                                             indent=1, default=str) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
