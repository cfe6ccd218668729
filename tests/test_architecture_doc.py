"""docs/architecture.md's copies of code are current (issue 45): its generated blocks equal what disagg/docs_gen.py
makes from the code now, §1's table of folders matches the tree (read from the disk, so a folder moved is seen),
the code names environment variables only through disagg/transport/environment.py, §11's usage block names the
CLI's commands and options, and §1's import rules hold.
Nothing here starts a process."""

from __future__ import annotations

import ast
import fnmatch
import os
import re
from functools import cache
from pathlib import Path

import click

from disagg import docs_gen
from disagg.settings.fields import by_path, leaves
from disagg.transport import environment
from tests.conftest import ROOT

DOC = ROOT / "docs" / "architecture.md"


def test_every_generated_block_is_what_the_code_makes_now():
    problems = docs_gen.problems(DOC.read_text())
    assert not problems, "docs/architecture.md:\n\n" + "\n\n".join(problems)


# --- §1: folders ----------------------------------------------------------------------------------------------------

#: what §1 does not ask to name: packages' __init__.py, and tests (tests/'s row describes them as a whole)
UNNAMED_FILES = ("__init__.py", "test_*.py")
#: a span that names a file or a folder (the others are prose: `Router`, `python -m ...`)
PATHLIKE = re.compile(r"\S+(/|\.(py|sh|txt|yaml|yml|json|html|md|sbatch))")


@cache
def _ignore_patterns() -> tuple[tuple[bool, str], ...]:
    """.gitignore's patterns as (anchored at the top, name or glob): all this repository's are of that kind."""
    lines = (line.strip() for line in (ROOT / ".gitignore").read_text().splitlines())
    return tuple((p.startswith("/"), p.strip("/")) for p in lines if p and not p.startswith("#"))


def ignored(rel: Path) -> bool:
    """Whether git ignores `rel` (a path under the repository), or it is .git itself."""
    return rel.parts[0] == ".git" or any(
        fnmatch.fnmatchcase(part, pattern) for anchored, pattern in _ignore_patterns()
        for part in (rel.parts[:1] if anchored else rel.parts))


def tree() -> tuple[list[Path], list[Path]]:
    """(folders, files) of the repository below its top, relative to it, without what git ignores. A folder is one
    that holds a file somewhere below it: git keeps no empty folder (.benchmarks/, which a pytest plugin makes)."""
    files = []
    for top, dirs, names in os.walk(ROOT):
        here = Path(top).relative_to(ROOT)
        dirs[:] = sorted(d for d in dirs if not ignored(here / d))
        files += [here / n for n in sorted(names) if not ignored(here / n)]
    folders = sorted({parent for f in files for parent in f.parents if parent != Path(".")})
    return folders, files


def rows() -> dict[str, list[str]]:
    """§1's table: folder ("disagg/roles/") -> the backticked spans of its row's description."""
    section = DOC.read_text().split("\n## 1. ", 1)[1].split("\n## 2. ", 1)[0]
    out = {}
    for line in section.splitlines():
        m = re.match(r"\| `([^`]+/)` \| (.*) \|$", line)
        if m:
            out[m.group(1)] = re.findall(r"`([^`]+)`", m.group(2))
    assert len(out) >= 10, "§1's table of folders not found"
    return out


def nearest_row(rel: Path, table: dict[str, list[str]]) -> tuple[str, str] | None:
    """The row of `rel`'s closest folder that has one, and `rel`'s path relative to that folder."""
    for parent in rel.parents:
        key = parent.as_posix() + "/"
        if key in table:
            return key, rel.relative_to(parent).as_posix()
    return None


def names_folder(spans: list[str], sub: str) -> bool:
    """A row names its subfolder `sub` ("routes") with a span into it (`routes/`, `static/index.html`,
    `models/*.yaml`) or a span for a folder above it (`results/` names results/2024/)."""
    return any(s.startswith(sub + "/") or (s.endswith("/") and (sub + "/").startswith(s)) for s in spans)


def names_file(spans: list[str], rel: str) -> bool:
    """A row names a file by its name, by its stem (a script: `router_bench`) when it lies in the row's own
    folder, by a path or glob from the row's folder (`traces/mixed.py`, `ckpt_*.py`), or by a folder above it."""
    name = rel.rpartition("/")[2]
    direct = "/" not in rel
    return any((direct and s in (name, name.rpartition(".")[0] or name)) or fnmatch.fnmatchcase(rel, s)
               or (s.endswith("/") and rel.startswith(s)) for s in spans)


def test_section_1_names_every_folder_and_file_of_the_tree():
    """Every top-level folder of the repository and every part of disagg/ (disagg/roles/) has a row in §1; every
    other folder has one or is named in the row of the closest folder above it that has one; and every file
    below a row's folder is named in its row."""
    table = rows()
    folders, files = tree()
    missing, unsaid = [], set()  # unsaid: folders said missing, whose contents go unsaid
    for rel in folders:
        key = rel.as_posix() + "/"
        if key in table or unsaid & set(rel.parents):
            continue
        row = nearest_row(rel, table)
        if len(rel.parts) == 1 or (len(rel.parts) == 2 and rel.parts[0] == "disagg"):
            missing.append(f"folder {key}: a row of its own")
        elif row is None or not names_folder(table[row[0]], row[1]):
            missing.append(f"folder {key}: in the row of {row[0] if row else 'its top folder'}")
        else:
            continue
        unsaid.add(rel)
    for rel in files:
        row = nearest_row(rel, table)
        if row is None or any(fnmatch.fnmatchcase(rel.name, p) for p in UNNAMED_FILES) or unsaid & set(rel.parents):
            continue
        if not names_file(table[row[0]], row[1]):
            missing.append(f"file {rel}: in the row of {row[0]}")
    assert not missing, "docs/architecture.md §1 does not name:\n" + "\n".join(missing)


def test_every_folder_and_file_section_1_names_exists():
    table = rows()
    wrong = []
    for folder, spans in table.items():
        base = ROOT / folder
        if not base.is_dir():
            wrong.append(f"row {folder}: no such folder")
            continue
        for span in spans:
            if not PATHLIKE.fullmatch(span):
                continue
            pattern = span.rstrip("/")  # a folder (`routes/`), a file or a glob, below the row's folder or the top
            found = [p for top in (base, ROOT) for p in top.glob(pattern)] + list(base.rglob(pattern))
            if not [p for p in found if p.is_dir() or not span.endswith("/")]:
                wrong.append(f"row {folder}: `{span}` is not there")
    assert not wrong, "docs/architecture.md §1 names what is not in the tree:\n" + "\n".join(wrong)


# --- environment variables ------------------------------------------------------------------------------------------

def _sources() -> list[Path]:
    return sorted(p for p in (ROOT / "disagg").rglob("*.py") if "__pycache__" not in p.parts)


def test_the_code_names_environment_variables_only_through_their_module():
    """A "DISAGG_..." string, or the name of a variable declared in disagg/transport/environment.py, written out
    anywhere else in disagg/ would be a variable §2's table cannot see."""
    declared = {v.name for v in environment.VARIABLES}
    home = Path(environment.__file__).resolve()
    spelled = []
    for path in _sources():
        if path.resolve() == home:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    re.fullmatch(r"DISAGG_[A-Z0-9_]+", node.value) or node.value in declared):
                spelled.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not spelled, ("declare these in disagg/transport/environment.py and use its constants:\n"
                         + "\n".join(spelled))


def _env_names(tree: ast.AST):
    """The expressions a module uses as an environment variable's name: the key of a dict display that is an
    environment (assigned to, returned by or passed as something named *env*, or an env's update), the index into
    an env, and the first argument of an env's get / setdefault / pop or of getenv / putenv."""
    def env(node) -> bool:
        return "env" in ast.unparse(node).lower()

    for node in ast.walk(tree):
        dicts = []
        if isinstance(node, ast.Assign) and any(env(t) for t in node.targets) or \
                isinstance(node, (ast.AnnAssign, ast.AugAssign)) and env(node.target):
            dicts.append(node.value)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "env" in node.name.lower():
            dicts += [r.value for r in ast.walk(node) if isinstance(r, ast.Return)]
        elif isinstance(node, ast.Subscript) and env(node.value):
            yield node.slice
        elif isinstance(node, ast.Call):
            dicts += [k.value for k in node.keywords if k.arg and "env" in k.arg]
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("getenv", "putenv") or isinstance(func, ast.Attribute) and env(func.value) and \
                    name in ("get", "setdefault", "pop"):
                yield from node.args[:1]
            elif isinstance(func, ast.Attribute) and env(func.value) and name == "update":
                dicts += node.args[:1]
        for d in dicts:
            if isinstance(d, ast.Dict):
                yield from (k for k in d.keys if k is not None)


def test_every_environment_variable_the_code_names_is_declared():
    """A variable set or read under a name written out (env["NCCL_DEBUG"] = ...) would be missing from §2's table:
    every name the code uses as one is a constant of disagg/transport/environment.py."""
    undeclared = []
    for path in _sources():
        for node in _env_names(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                undeclared.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not undeclared, ("declare these in disagg/transport/environment.py and use its constants:\n"
                            + "\n".join(undeclared))


def test_every_declared_variable_is_used_and_a_settings_is_that_settings():
    uses = docs_gen.variable_uses()
    elsewhere = "\n".join(p.read_text(errors="replace") for top in ("tests", "deploy", "benchmarks")
                          for p in (ROOT / top).rglob("*") if p.is_file() and p.suffix in (".py", ".sh", ".sbatch", ".yaml"))
    for v in environment.VARIABLES:
        assert uses[v.name]["sets"] or uses[v.name]["reads"] or v.name in elsewhere, f"{v.name} is used nowhere"
        if v.setting:
            assert by_path()[v.setting].env == v.name, (v.name, v.setting)
    assert len({v.name for v in environment.VARIABLES}) == len(environment.VARIABLES)


# --- §11: the CLI's usage ---------------------------------------------------------------------------------------------

def usage() -> dict[tuple[str, ...], set[str]]:
    """§11's usage block: command path (("bench", "transfer")) -> the options its lines name."""
    from disagg.launcher.cli.main import cli

    block = DOC.read_text().split("\n## 11. ", 1)[1].split("```")[1]
    out: dict[tuple[str, ...], set[str]] = {}
    current = None
    for line in block.splitlines():
        if line.startswith("disagg "):  # a command's first line; indented ones go on with it
            path, group = [], cli
            for word in line.split()[1:]:
                if not isinstance(group, click.Group) or word not in group.commands:
                    break
                path.append(word)
                group = group.commands[word]
            current = tuple(path) or None  # `disagg [-v] COMMAND ...`: every command's
        if current:
            out.setdefault(current, set()).update(re.findall(r"(?<![\w-])--?[a-z][\w-]*", line))
    return out


def _commands(group, path=()):
    for name, cmd in group.commands.items():
        if any(isinstance(p, click.Option) for p in cmd.params) or not isinstance(cmd, click.Group):
            yield (*path, name), cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*path, name))


def test_section_11_names_every_command_and_option_and_no_other():
    """Every command has a usage line naming each of its options (launch: those that are not a setting's flag,
    which it sums up as [every schema flag]); no line names an option its command does not take."""
    from disagg.launcher.cli.main import cli

    schema = {f for leaf in leaves() if leaf.flag for f in leaf.flag.split("/")}
    lines = usage()
    wrong = []
    for path, cmd in _commands(cli):
        options = {o for p in cmd.params if isinstance(p, click.Option) for o in (*p.opts, *p.secondary_opts)}
        named = lines.get(path)
        if named is None:
            wrong.append(f"disagg {' '.join(path)}: no usage line")
            continue
        wrong += [f"disagg {' '.join(path)}: no option {o}" for o in sorted(named - options - {"--help"})]
        if path == ("launch",):
            options = {o for o in options if o not in schema and not o.startswith("--gpus-per-")}
        wrong += [f"disagg {' '.join(path)}: {o} is not named" for o in sorted(options - named - {"--help"})]
    assert not wrong, "docs/architecture.md §11's usage block against the CLI:\n" + "\n".join(wrong)


# --- §1: import rules -----------------------------------------------------------------------------------------------

#: §1's import rules: what each part of disagg/ may import of ours besides itself (None: anything)
MAY_IMPORT = {
    "transport": (), "common": (), "settings": ("transport",), "client": ("transport",),
    "orchestrator": ("transport", "settings", "common"), "roles": ("transport", "settings", "common"),
    "gateway": ("client", "transport", "settings"), "launcher": None,
    "__init__.py": (), "__main__.py": ("launcher",), "docs_gen.py": ("settings", "transport"),
    "docs_site.py": None,
}


def _ours(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import of ours in a module, indented ones included."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "disagg" else [f"disagg.{a.name}" for a in node.names]
            out += [(node.lineno, n) for n in names if n.startswith("disagg.")]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("disagg.")]
    return out


def test_the_import_rules_of_section_1_hold():
    broken = []
    for path in _sources():
        part = path.relative_to(ROOT / "disagg").parts[0]
        assert part in MAY_IMPORT, f"disagg/{part}: a part of disagg/ §1's import rules (and MAY_IMPORT) do not cover"
        allowed = MAY_IMPORT[part]
        for line, module in _ours(ast.parse(path.read_text())):
            target = module.split(".")[1]
            if allowed is not None and target != part and target not in allowed and f"{target}.py" not in allowed:
                broken.append(f"{path.relative_to(ROOT)}:{line}: imports {module}")
    for path in sorted((ROOT / "tools").glob("*.py")):
        broken += [f"{path.relative_to(ROOT)}:{line}: imports {module}" for line, module in _ours(ast.parse(path.read_text()))
                   if not module.startswith("disagg.roles.pipelines")]
    assert not broken, "against docs/architecture.md §1's import rules:\n" + "\n".join(broken)
