"""Submitting a prompts file: progress, saving images named by request id, the summary."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from launcher.client import Client, Outcome
from transport.messages import GenerationParams


EXTENSIONS = {"jpeg": "jpg"}


def save_images(outcome: Outcome, out_dir: Path) -> list[Path]:
    """One file per image (or video), named by request id, with the extension of its format."""
    fmt = outcome.image_format.lower()
    ext = EXTENSIONS.get(fmt, fmt)
    paths = []
    for k, data in enumerate(outcome.images):
        suffix = "" if len(outcome.images) == 1 else f"_{k}"
        path = out_dir / f"{outcome.request_id}{suffix}.{ext}"
        path.write_bytes(data)
        paths.append(path)
    return paths


def outcome_record(outcome: Outcome, paths: list[Path]) -> dict:
    return {
        "request_id": outcome.request_id,
        "ok": outcome.ok,
        "error": outcome.error,
        "prompt": outcome.params.prompt,
        "seed": outcome.seed,
        "files": [str(p) for p in paths],
        "latency_s": round(outcome.latency_s, 6),
        "timings": outcome.timings,
    }


def run_prompts(
    client: Client,
    params: list[GenerationParams],
    out_dir: Path | None,
    concurrency: int,
    console: Console,
    as_json: bool = False,
    timeout_s: float | None = None,
    cancelled=None,
) -> int:
    """Run every prompt; save images; print a summary (or JSON). Exit code 0 only if all succeeded."""
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    show_bar = len(params) > 1 and not as_json
    progress = Progress(
        TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, disable=not show_bar, transient=False,
    )
    with progress:
        task = progress.add_task("requests", total=len(params))

        def on_outcome(outcome: Outcome) -> None:
            paths = save_images(outcome, out_dir) if (out_dir is not None and outcome.ok) else []
            records.append(outcome_record(outcome, paths))
            progress.advance(task)
            if not as_json:
                if outcome.ok:
                    where = ", ".join(str(p) for p in paths) or f"{len(outcome.images)} image(s)"
                    progress.console.print(f"[green]ok[/] {outcome.request_id} {outcome.latency_s:.2f} s -> {where}")
                else:
                    progress.console.print(f"[red]failed[/] {outcome.request_id}: {outcome.error}")

        outcomes = client.run_all(params, concurrency=concurrency, timeout_s=timeout_s, on_outcome=on_outcome, cancelled=cancelled)
    failed = sum(1 for o in outcomes if not o.ok) + (len(params) - len(outcomes))
    if as_json:
        console.print_json(json.dumps({"results": records, "completed": len(params) - failed, "failed": failed}))
    else:
        console.print(f"{len(params) - failed}/{len(params)} requests succeeded")
    return 0 if failed == 0 else 1
