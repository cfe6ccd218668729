"""The parts of docs/architecture.md that are copies of code, made from the code.

    python -m disagg.docs_gen            say which generated blocks are out of date (a diff each), exit 1 if any
    python -m disagg.docs_gen --write    rewrite them in docs/architecture.md

A block sits between `<!-- generated: NAME ... -->` and `<!-- end generated -->`; everything outside the
markers is prose and stays as written. Each block is a pure function of the code: the settings schema
(disagg/settings/), the processes' settings objects (disagg/settings/process.py), and the environment variables
declared in disagg/transport/environment.py together with where disagg/'s modules use them (read from their
source, not imported). tests/test_architecture_doc.py fails with the same diff while a block is out of date.
"""

from __future__ import annotations

import ast
import difflib
import re
import sys
from functools import cache
from pathlib import Path

import msgspec

from disagg.settings import process
from disagg.settings.fields import by_path, for_process, leaves, sections, sections_for, top_level_for
from disagg.settings.render import value_text
from disagg.settings.schema import ROLE_SECTIONS, Settings
from disagg.transport import environment

PACKAGE = Path(__file__).resolve().parent
DOC = PACKAGE.parent / "docs" / "architecture.md"
BEGIN = "<!-- generated: {name} (python -m disagg.docs_gen --write) -->"
END = "<!-- end generated -->"
_BLOCK = re.compile(r"<!-- generated: (\S+)[^>]*-->\n(.*?)" + re.escape(END), re.S)

#: the settings §10 lists the defaults of (the rest are in configs/tiny.yaml and docs/guide/settings.md's table)
DEFAULTS_WORTH_KNOWING = (
    "model", "port", "transfer", "dispatch", "schedule.order", "admission", "timeouts.heartbeat", "timeouts.stall",
    "timeouts.request", "join_wait", "max_retries", "max_queue", "timeouts.ready", "spares", "fork_server", "lane",
    "http.port", "rebalance.mode",
)
#: each process's settings object (disagg/settings/process.py), in the order §2 lists them
PROCESS_OBJECTS = (("orchestrator", process.OrchestratorSettings), ("gateway", process.GatewaySettings),
                   ("role", process.RoleSettings))


def _names(names) -> str:
    return "`" + " ".join(names) + "`" if names else "—"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _value(value) -> str:
    """A default as a document shows it: a string (an enum's value too) as it is, anything else as YAML."""
    value = msgspec.to_builtins(value)
    return value if isinstance(value, str) and value else value_text(value)


# --- §2: each process's settings object ---------------------------------------------------------------------------

def settings_per_process() -> str:
    """Each process's settings object: the fields the launcher works out for it, the top-level schema fields whose
    `use(...)` names the process, and the sections it gets whole (sections_for)."""
    rows = ["| process | settings object | launcher-made fields | schema fields (top level) | schema sections, whole |",
            "|---|---|---|---|---|"]
    for name, kind in PROCESS_OBJECTS:
        schema = (*top_level_for(name), *sections_for(name))
        own = [f for f in kind.__struct_fields__ if f not in schema]
        rows.append(f"| {name} | `{kind.__name__}` | {_names(own)} | {_names(top_level_for(name))} | "
                    f"{_names(sections_for(name))} |")
    pools = list(dict.fromkeys(leaf.section for leaf in for_process("launcher") if leaf.section))
    rows.append(f"| launcher | `Settings`, all of it | — | {_names(top_level_for('launcher'))} | {_names(pools)} |")
    return "\n".join(rows) + "\n"


# --- §2: environment variables ------------------------------------------------------------------------------------

def _sets(parent: ast.AST, node: ast.AST) -> bool:
    """Whether `node` (a variable's name) is used to set the variable: a key of a dict display (a child's
    environment), the index of an assignment (`env[X] = ...`), or `setdefault(X, ...)`'s first argument."""
    if isinstance(parent, ast.Dict):
        return any(k is node for k in parent.keys)
    if isinstance(parent, ast.Subscript):
        return parent.slice is node and isinstance(parent.ctx, ast.Store)
    if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute):
        return parent.func.attr in ("setdefault", "putenv") and bool(parent.args) and parent.args[0] is node
    return False


def _module_uses(tree: ast.Module) -> dict[str, set[str]]:
    """variable name -> {"sets", "reads"}: how one module's code uses the declared variables."""
    declared = {v.name for v in environment.VARIABLES}
    names: dict[str, str] = {}  # local name -> variable
    modules: set[str] = set()  # local names of the environment module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == environment.__name__:
            names.update({a.asname or a.name: a.name for a in node.names if a.name in declared})
        elif isinstance(node, ast.ImportFrom) and f"{node.module}.environment" == environment.__name__:
            modules.update(a.asname or a.name for a in node.names if a.name == "environment")
        elif isinstance(node, ast.Import):
            modules.update(a.asname for a in node.names if a.name == environment.__name__ and a.asname)
    out: dict[str, set[str]] = {}
    for parent in ast.walk(tree):
        for node in ast.iter_child_nodes(parent):
            if isinstance(node, ast.Name) and node.id in names:
                name = names[node.id]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                    and node.attr in declared:
                name = node.attr
            else:
                continue
            out.setdefault(name, set()).add("sets" if _sets(parent, node) else "reads")
    return out


@cache
def variable_uses() -> dict[str, dict[str, tuple[str, ...]]]:
    """variable name -> {"sets": modules, "reads": modules}, each module as its path under disagg/, sorted."""
    found: dict[str, dict[str, set[str]]] = {v.name: {"sets": set(), "reads": set()} for v in environment.VARIABLES}
    home = Path(environment.__file__).resolve()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.resolve() == home or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(PACKAGE).as_posix()
        for name, kinds in _module_uses(ast.parse(path.read_text(), str(path))).items():
            for kind in kinds:
                found[name][kind].add(rel)
    return {name: {k: tuple(sorted(v)) for k, v in kinds.items()} for name, kinds in found.items()}


def environment_table() -> str:
    """Every declared variable: where disagg/'s code sets it (for a child, or for itself), where it reads it, and
    what it holds."""
    rows = ["| variable | set in (disagg/...) | read in (disagg/...) | what |", "|---|---|---|---|"]
    uses = variable_uses()
    for v in environment.VARIABLES:
        what = v.what + (f" (the setting `{v.setting}`)" if v.setting else "")
        cells = [", ".join(f"`{m}`" for m in uses[v.name][k]) or "—" for k in ("sets", "reads")]
        rows.append(f"| `{v.name}` | {cells[0]} | {cells[1]} | {_cell(what)} |")
    return "\n".join(rows) + "\n"


# --- §10: the schema's sections, pool defaults, older names, defaults worth knowing -------------------------------

def settings_sections() -> str:
    """The schema's sections, by struct: which sections are one, and its fields."""
    rows = ["| sections | struct | fields |", "|---|---|---|"]
    defaults = Settings()
    by_struct: dict[type, list[str]] = {}
    for name in sections():
        by_struct.setdefault(type(getattr(defaults, name)), []).append(name)
    for struct, names in by_struct.items():
        rows.append(f"| {', '.join(f'`{n}`' for n in names)} | `{struct.__name__}` | "
                    f"{_names(struct.__struct_fields__)} |")
    return "\n".join(rows) + "\n"


def pool_defaults() -> str:
    """Each role pool's defaults (the sections encoders, denoisers, decoders)."""
    defaults = Settings()
    fields = type(defaults.role("encoder")).__struct_fields__
    rows = ["| pool | " + " | ".join(fields) + " |", "|---|" + "---|" * len(fields)]
    for role in ROLE_SECTIONS:
        pool = msgspec.to_builtins(defaults.role(role))
        rows.append(f"| `{ROLE_SECTIONS[role]}` | " + " | ".join(_cell(_value(pool[f])) for f in fields) + " |")
    return "\n".join(rows) + "\n"


def older_names() -> str:
    """Every older key a config file may still use (and its DISAGG_ variable), with the key it is now."""
    pairs = [f"`{old}` → `{leaf.path}`" for leaf in leaves() for old in leaf.legacy]
    return "Older keys (their `DISAGG_` variables too): " + ", ".join(pairs) + ".\n"


def defaults_worth_knowing() -> str:
    known = by_path()
    return "Defaults: " + ", ".join(f"`{p}: {_value(known[p].default)}`" for p in DEFAULTS_WORTH_KNOWING) + ".\n"


#: every block, by name: what §2 and §10 hold between their markers
BLOCKS = {
    "settings-per-process": settings_per_process,
    "environment": environment_table,
    "settings-sections": settings_sections,
    "pool-defaults": pool_defaults,
    "older-names": older_names,
    "defaults": defaults_worth_knowing,
}


# --- the document -------------------------------------------------------------------------------------------------

def problems(text: str) -> list[str]:
    """What is wrong with `text`'s generated blocks: a block missing, named twice or unknown, or out of date (with
    its diff)."""
    found = [(m.group(1), m.group(2)) for m in _BLOCK.finditer(text)]
    names = [name for name, _ in found]
    out = [f"block {n!r} is missing: put {BEGIN.format(name=n)} and {END} where it belongs, then --write"
           for n in BLOCKS if n not in names]
    out += [f"block {n!r} appears {names.count(n)} times" for n in dict.fromkeys(names) if names.count(n) > 1]
    out += [f"block {n!r} is not one disagg.docs_gen makes ({', '.join(BLOCKS)})" for n in names if n not in BLOCKS]
    for name, body in found:
        if name in BLOCKS and body != (want := BLOCKS[name]()):
            diff = difflib.unified_diff(body.splitlines(), want.splitlines(), "docs/architecture.md", "the code",
                                        lineterm="", n=0)
            out.append(f"block {name!r} is out of date (python -m disagg.docs_gen --write):\n" + "\n".join(diff))
    return out


def rewrite(text: str) -> str:
    """`text` with every known block made again from the code (the marker lines are written afresh too)."""
    def block(m: re.Match) -> str:
        name = m.group(1)
        if name not in BLOCKS:
            return m.group(0)
        return f"{BEGIN.format(name=name)}\n{BLOCKS[name]()}{END}"
    return _BLOCK.sub(block, text)


def main(argv: list[str]) -> int:
    if argv not in ([], ["--write"]):
        print(__doc__.strip().splitlines()[0] + "\nusage: python -m disagg.docs_gen [--write]", file=sys.stderr)
        return 2
    text = DOC.read_text()
    if argv == ["--write"]:
        new = rewrite(text)
        if new != text:
            DOC.write_text(new)
            print(f"rewrote {DOC}")
        text = new
    found = problems(text)
    for p in found:
        print(p)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
