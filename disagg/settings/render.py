"""Documents made from the schema: configs/tiny.yaml, the settings table of docs/guide/settings.md, `launch --print-config`.

    python -m disagg.settings yaml > configs/tiny.yaml     (tests/test_settings.py checks the file is current)
    python -m disagg.settings table                        (the settings table of docs/guide/settings.md, between its markers)
"""

from __future__ import annotations

import textwrap

import msgspec
import yaml

from disagg.settings.fields import Leaf, bounds, leaves, sections, type_name

HEADER = """\
The built-in deployment: the demo Flux model on the CPU, 1 encoder : 2 denoisers : 1 decoder.
`disagg launch` without --config uses exactly these values. Generated from disagg/settings/schema.py by
`python -m disagg.settings yaml > configs/tiny.yaml` (a test checks it is current): every setting, with its help.

Precedence: a flag over its DISAGG_<NAME> variable over a config file over these defaults. A key inside a
section is DISAGG_<SECTION>_<NAME>, e.g. http.port is DISAGG_HTTP_PORT. Unknown keys and unknown DISAGG_
variables are refused. `disagg launch --print-config [flags]` shows the merged result and where each
value came from."""

WIDTH = 100
#: settings --print-config does not show the value of
SECRETS = ("http.api_key", "http.api_keys")


def value_text(value) -> str:
    value = msgspec.to_builtins(value)  # an enum member as its string
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip().removesuffix("\n...").strip()


def _comment(text: str, indent: str = "") -> list[str]:
    out = []
    for para in text.split("\n\n"):
        out += [f"{indent}# {line}" for line in textwrap.wrap(para, WIDTH - len(indent) - 2)]
    return out


def _leaf_lines(leaf: Leaf, value, indent: str = "") -> list[str]:
    name = leaf.path.rpartition(".")[2]
    where = [leaf.env] + ([leaf.flag] if leaf.flag else [])
    help_text = f"{leaf.help}\n\n({', '.join(where)}; {type_name(leaf.type)}" + \
        (f", {bounds(leaf.type)}" if bounds(leaf.type) else "") + ")"
    return _comment(help_text, indent) + [f"{indent}{name}: {value_text(value)}"]


def tiny_yaml() -> str:
    """configs/tiny.yaml: every setting at its default, its help as comments above it."""
    lines = [f"# {line}" if line else "#" for line in HEADER.splitlines()]
    done_sections: set[str] = set()
    for leaf in leaves():
        if not leaf.section:
            lines += ["", *_leaf_lines(leaf, leaf.default)]
            continue
        if leaf.section not in done_sections:
            done_sections.add(leaf.section)
            lines += ["", *_comment(sections()[leaf.section]), f"{leaf.section}:"]
        lines += _leaf_lines(leaf, leaf.default, "  ")
    return "\n".join(lines) + "\n"


def readme_table() -> str:
    """The table of every setting (docs/guide/settings.md, docs/reference/settings.md) (key, flag, variable, default, who reads it, help)."""
    rows = ["| key | flag | variable | default | read by | what |", "|---|---|---|---|---|---|"]
    for leaf in leaves():
        what = leaf.short_help.replace("|", "\\|")
        typ = type_name(leaf.type).replace("|", "\\|")
        rows.append(f"| `{leaf.path}` | {f'`{leaf.flag}`' if leaf.flag else '(file, env)'} | `{leaf.env}` | "
                    f"`{value_text(leaf.default)}` | {', '.join(leaf.processes)} | {typ}: {what} |")
    return "\n".join(rows) + "\n"


def effective_yaml(resolved) -> str:
    """`launch --print-config`: the merged settings as YAML, each value with where it came from."""
    data = msgspec.to_builtins(resolved.settings)
    lines, current = [], None
    for leaf in leaves():
        section, _, name = leaf.path.rpartition(".")
        value = (data[section] if section else data)[name]
        if section and section != current:
            lines.append(f"{section}:")
        current = section
        origin = resolved.origins.get(leaf.path, "default")
        source = {"flag": f"flag {leaf.flag or ''}".strip(), "env": f"env {leaf.env}", "file": "file"}.get(origin, "default")
        if leaf.path in SECRETS and value:  # a key's priority may show, never the key
            value = {"(set)": sorted(value.values(), key=str)} if isinstance(value, dict) else "(set)"
        lines.append(f"{'  ' if section else ''}{name}: {value_text(value)}  # {source}")
    return "\n".join(lines) + "\n"
