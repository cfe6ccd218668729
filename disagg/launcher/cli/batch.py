"""Submitting a prompts file: progress, saving images named by request id, a manifest, the summary."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from disagg.client import Client, Outcome
from disagg.transport.wire.codes import CLIENT_FAULT, ErrorCode
from disagg.transport.wire.messages import GenerationParams

#: codes of a request refused at Submit, before anything ran (`submit` says "refused", not "failed")
REFUSED = frozenset({ErrorCode.DEADLINE, ErrorCode.OVERLOADED, ErrorCode.NOT_READY, ErrorCode.UNAVAILABLE})


EXTENSIONS = {"jpeg": "jpg"}
#: one JSON line per request beside the images (appended to, so several batches into one folder add up)
MANIFEST = "manifest.jsonl"


class OutDirError(ValueError):
    """An output folder that cannot be written to; the message names it and the cause."""


def check_out_dir(out_dir: Path) -> None:
    """Fail now, before anything starts, if images could not be written to `out_dir`.

    Writes and removes a probe file in the folder, or in its nearest existing parent when it does not
    exist yet (it is created only once there is something to write)."""
    here = out_dir
    while not here.exists():
        if here.parent == here:
            break
        here = here.parent
    if here.exists() and not here.is_dir():
        raise OutDirError(f"{out_dir}: {here} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=here, prefix=".disagg-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutDirError(f"cannot write into {here}: {exc.strerror or exc}") from None


def _write_atomic(path: Path, data: bytes) -> None:
    """Write under a temporary name, then rename: a failed write (a full disk) leaves no partial file."""
    tmp = path.with_name(f".{path.name}.part")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def save_images(outcome: Outcome, out_dir: Path) -> list[Path]:
    """One file per image (or video), named by request id, with the extension of its format.
    Raises OSError; the files of this outcome written before the error are removed."""
    fmt = outcome.image_format.lower()
    ext = EXTENSIONS.get(fmt, fmt)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    try:
        for k, data in enumerate(outcome.images):
            suffix = "" if len(outcome.images) == 1 else f"_{k}"
            path = out_dir / f"{outcome.request_id}{suffix}.{ext}"
            _write_atomic(path, data)
            paths.append(path)
    except OSError:
        for path in paths:
            path.unlink(missing_ok=True)
        raise
    return paths


def outcome_record(outcome: Outcome, paths: list[Path], index: int | None = None, model: str = "") -> dict:
    """A request's line in the manifest and in --json: what was asked, what it ran with, where it went."""
    resolved = dict(outcome.resolved)
    width = resolved.get("width", outcome.params.width)
    height = resolved.get("height", outcome.params.height)
    return {
        "index": index,
        "request_id": outcome.request_id,
        "ok": outcome.ok,
        "error": outcome.error,
        "prompt": outcome.params.prompt,
        "negative_prompt": outcome.params.negative_prompt,
        "seed": outcome.seed,
        "size": f"{width}x{height}" if width and height else None,
        "steps": resolved.get("num_inference_steps", outcome.params.num_inference_steps),
        "guidance_scale": resolved.get("guidance_scale", outcome.params.guidance_scale),
        "model": resolved.get("model", model) or None,
        #: the LoRA adapters and scales it applied ("A:1,B:0.5"), as the PNG's text chunks record them too
        "loras": resolved.get("loras") or None,
        #: its step cache ("first_block threshold=0.3"), and the denoising steps it computed and skipped
        "cache": resolved.get("cache") or None,
        "steps_computed": resolved.get("steps_computed"),
        "steps_skipped": resolved.get("steps_skipped"),
        #: scheduling: its priority and deadline as sent (None: not set)
        "priority": outcome.params.priority,
        "slo_ms": outcome.params.slo_ms,
        "files": [str(p) for p in paths],
        "latency_s": round(outcome.latency_s, 6),
        "timings": outcome.timings,
    }


def save_preview(folder: Path, console: Console, quiet: bool):
    """What `submit --previews DIR` does with each live preview: REQUEST-preview-N.EXT in DIR, as it arrives."""

    def on_partial(partial, image: bytes) -> None:
        path = folder / f"{partial.request_id}-preview-{partial.index}.{partial.image_format}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_bytes(image)
        except OSError as exc:
            console.print(f"cannot save a preview into {folder}: {exc.strerror or exc}", markup=False)
            return
        if not quiet:
            console.print(f"preview {partial.request_id} step {partial.step}/{partial.steps} -> {path}", markup=False)
    return on_partial


def run_prompts(
    client: Client,
    params: list[GenerationParams],
    out_dir: Path | None,
    concurrency: int,
    console: Console,
    as_json: bool = False,
    timeout_s: float | None = None,
    cancelled=None,
    model: str = "",
    previews_dir: Path | None = None,
) -> int:
    """Run every prompt; save images and a manifest line each; print a summary (or JSON).

    Exit code 0 only if all succeeded, 2 if every failure was the request's own fault (an unknown LoRA
    adapter, a size over the model's maximum: the request is wrong, not the deployment), else 1 if any failed,
    130 on Ctrl-C (after the summary of what finished). A failed write fails only its own request."""
    records: list[dict] = []
    index_of: dict[str, int] = {}
    show_bar = len(params) > 1 and not as_json
    progress = Progress(
        TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, disable=not show_bar, transient=False,
    )
    manifest = None

    def on_outcome(outcome: Outcome) -> None:
        nonlocal manifest
        paths: list[Path] = []
        if out_dir is not None and outcome.ok:
            try:
                paths = save_images(outcome, out_dir)
            except OSError as exc:
                outcome.ok, outcome.error = False, f"cannot save into {out_dir}: {exc.strerror or exc}"
        record = outcome_record(outcome, paths, index_of.get(outcome.request_id), model)
        records.append(record)
        if out_dir is not None:  # every request's line, failures too (the folder is made for it)
            try:
                if manifest is None:
                    out_dir.mkdir(parents=True, exist_ok=True)
                    manifest = open(out_dir / MANIFEST, "a")
                manifest.write(json.dumps(record) + "\n")
                manifest.flush()
            except OSError:
                pass  # a full disk: the images that made it are listed in the summary
        progress.advance(task)
        if not as_json:
            if outcome.ok:
                where = ", ".join(str(p) for p in paths) or f"{len(outcome.images)} image(s)"
                line = Text.assemble(("ok", "green"), f" {outcome.request_id} {outcome.latency_s:.2f} s -> {where}")
            elif outcome.code in REFUSED:  # nothing ran: the deployment would not take it
                line = Text.assemble(("refused", "red"), f" {outcome.request_id}: {outcome.error}")
            else:
                line = Text.assemble(("failed", "red"), f" {outcome.request_id}: {outcome.error}")
            progress.console.print(line)
        if not outcome.ok and outcome.code not in CLIENT_FAULT:
            deployment_failed.append(outcome.request_id)

    from disagg.client import new_request_id

    deployment_failed: list[str] = []  # failures that were not the request's own fault
    ids = [new_request_id() for _ in params]
    index_of.update({rid: i for i, rid in enumerate(ids)})
    code = None
    with progress:
        task = progress.add_task("requests", total=len(params))
        try:
            client.run_all(params, concurrency=concurrency, timeout_s=timeout_s, on_outcome=on_outcome,
                           ids=ids, cancelled=cancelled,
                           on_partial=save_preview(previews_dir, progress.console, as_json) if previews_dir else None)
        except KeyboardInterrupt:
            code = 130
        finally:
            if manifest is not None:
                manifest.close()
    ok = sum(1 for r in records if r["ok"])
    failed = len(records) - ok
    not_run = len(params) - len(records)
    if as_json:
        console.print_json(json.dumps({"results": records, "completed": ok, "failed": failed, "not_run": not_run,
                                       "interrupted": code == 130}))
    else:
        tail = f" ({not_run} not run: interrupted)" if code == 130 else ""
        console.print(f"{ok}/{len(params)} requests succeeded{tail}", markup=False)
        if out_dir is not None and records and (out_dir / MANIFEST).exists():
            console.print(f"manifest: {out_dir / MANIFEST}", markup=False)
    if code is not None:
        return code
    if ok == len(params):
        return 0
    return 1 if deployment_failed else 2
