"""Prompt files: one JSON object, a JSON list of them, or JSON Lines; validated field by field."""

from __future__ import annotations

from pathlib import Path

import msgspec

from disagg.client.inputs import InputError, resolve_inputs
from disagg.transport.wire.messages import GenerationParams, MessageError, params_from_obj

MAX_PROMPTS_FILE_BYTES = 64 * 1024 * 1024


class PromptError(ValueError):
    """A prompts file that cannot be turned into requests; the message names the cause."""


def parse_prompts(text: str | bytes, source: str = "prompts", base: Path | None = None) -> list[GenerationParams]:
    """`base`: the folder relative image paths are read from (the prompts file's)."""
    data = text.encode() if isinstance(text, str) else text
    if not data.strip():
        raise PromptError(f"{source}: empty file, expected a JSON object, a list, or JSON Lines")
    try:
        doc = msgspec.json.decode(data)
        items = doc if isinstance(doc, list) else [doc]
        # entries counted from 1, as a person counts them
        where = (lambda i: f"{source}: entry {i + 1}") if isinstance(doc, list) else (lambda i: source)
    except msgspec.DecodeError as whole_err:
        items, line_of, lines = [], [], data.splitlines()
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                items.append(msgspec.json.decode(line))
                line_of.append(n)
            except msgspec.DecodeError as exc:
                if len(lines) == 1 or n == 1:
                    raise PromptError(f"{source}: invalid JSON: {whole_err}") from None
                raise PromptError(f"{source}: line {n}: invalid JSON: {exc}") from None
        where = lambda i: f"{source}: line {line_of[i]}"  # noqa: E731 - the file's own line numbers
    if not items:
        raise PromptError(f"{source}: no prompts found")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise PromptError(f"{where(i)}: expected a JSON object with a \"prompt\" field, got {type(item).__name__}")
        try:
            out.append(params_from_obj(resolve_inputs(item, base)))
        except (MessageError, InputError) as exc:
            raise PromptError(f"{where(i)}: {exc}") from None
    return out


def load_prompts(path: str | Path) -> list[GenerationParams]:
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_PROMPTS_FILE_BYTES:
            raise PromptError(f"{p}: {size} bytes is over the {MAX_PROMPTS_FILE_BYTES}-byte limit for a prompts file")
        data = p.read_bytes()
    except OSError as exc:
        raise PromptError(f"cannot read {p}: {exc.strerror}") from None
    return parse_prompts(data, str(p), p.parent)
