"""The schema's fields as a flat list of leaves: what flags, files, variables and documents are made from."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import msgspec
import msgspec.inspect as mi

from disagg.settings.schema import ROLE_SECTIONS, SECTION_FLAGS, Settings

ENV_PREFIX = "DISAGG_"


@dataclass(frozen=True)
class Leaf:
    """One setting: `path` ("join_wait", "http.port", "denoisers.count")."""

    path: str
    type: object  # msgspec.inspect type, without its Metadata wrapper
    default: object
    help: str
    processes: tuple[str, ...]
    flag: str | None  # "--name", "--a/--no-a", "-e/--encoders"; None: file and environment only
    #: the older keys' whole paths ("compile_mode" for compile.mode), newest first: they still work, with a warning
    legacy: tuple[str, ...]
    metavar: str

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.path.replace(".", "_").upper()

    @property
    def legacy_envs(self) -> tuple[str, ...]:
        """The older keys' variables (but one that is the same as env: compile_mode's)."""
        envs = (ENV_PREFIX + old.replace(".", "_").upper() for old in self.legacy)
        return tuple(env for env in envs if env != self.env)

    @property
    def section(self) -> str:
        return self.path.rpartition(".")[0]

    @property
    def short_help(self) -> str:
        return self.help.split("\n\n")[0]

    @property
    def is_flag(self) -> bool:
        return isinstance(self.type, mi.BoolType)


def _names(legacy) -> tuple[str, ...]:
    return (legacy,) if isinstance(legacy, str) and legacy else tuple(legacy or ())


def _unwrap(t):
    if isinstance(t, mi.Metadata):
        return t.type, t.extra_json_schema or {}, t.extra or {}
    return t, {}, {}


@cache
def sections() -> dict[str, str]:
    """section name -> its help (the section struct's docstring)."""
    out = {}
    defaults = Settings()
    for f in mi.type_info(Settings).fields:
        value = getattr(defaults, f.name)
        if isinstance(value, msgspec.Struct):
            out[f.name] = " ".join((type(value).__doc__ or "").split())
    return out


@cache
def leaves() -> tuple[Leaf, ...]:
    """Every setting, in declaration order, sections' fields under their section."""
    out = []
    defaults = Settings()

    def walk(struct_type, instance, prefix):
        for f in mi.type_info(struct_type).fields:
            value = getattr(instance, f.name)
            if isinstance(value, msgspec.Struct):
                walk(type(value), value, f"{prefix}{f.name}.")
                continue
            t, schema, extra = _unwrap(f.type)
            path = prefix + f.name
            flag = extra.get("flag", None) if extra else None
            if extra and flag == "":
                flag = "--" + path.replace(".", "-").replace("_", "-")
            flag = SECTION_FLAGS.get(path, flag)
            out.append(Leaf(path, t, value, schema.get("description", ""), tuple(extra.get("for", ())), flag,
                            _names(extra.get("legacy", ())), extra.get("metavar", "")))

    walk(Settings, defaults, "")
    return tuple(out)


@cache
def by_path() -> dict[str, Leaf]:
    return {leaf.path: leaf for leaf in leaves()}


def default(path: str):
    """The schema's default of a setting: what a constructor that takes one defaults to, so none disagrees."""
    return by_path()[path].default


def for_process(process: str) -> tuple[Leaf, ...]:
    return tuple(leaf for leaf in leaves() if process in leaf.processes)


def sections_for(process: str) -> tuple[str, ...]:
    """The sections `process` reads (a field of theirs names it in its `use`), whole: the process's settings object
    carries each as the schema's struct. The role pools (encoders, denoisers, decoders) are the launcher's; the
    orchestrator gets their standby counts by role (its `standby`)."""
    pools = set(ROLE_SECTIONS.values())
    return tuple(dict.fromkeys(leaf.section for leaf in for_process(process)
                               if leaf.section and leaf.section not in pools))


def top_level_for(process: str) -> tuple[str, ...]:
    """The names of the top-level settings `process` reads (its settings object carries them as they are)."""
    return tuple(leaf.path for leaf in for_process(process) if "." not in leaf.path)


def type_name(t) -> str:
    """A short name of a leaf's type for documents: int, float, bool, str, list[int], one of a|b, map."""
    if isinstance(t, mi.UnionType):
        parts = [type_name(x) for x in t.types if not isinstance(x, mi.NoneType)]
        return " | ".join(parts) + " | null"
    if isinstance(t, (mi.LiteralType, mi.EnumType)):
        return " | ".join(repr(v) if v == "" else str(v) for v in choices(t))
    if isinstance(t, mi.ListType):
        return f"list[{type_name(t.item_type)}]"
    if isinstance(t, mi.DictType):
        return "map"
    return {mi.IntType: "int", mi.FloatType: "float", mi.BoolType: "bool", mi.StrType: "str"}.get(type(t), "value")


def choices(t) -> tuple[str, ...]:
    """The values a choice-valued leaf takes, sorted (as msgspec gives a Literal's)."""
    return tuple(sorted(m.value for m in t.cls)) if isinstance(t, mi.EnumType) else tuple(t.values)


def bounds(t) -> str:
    """'>= 1, <= 256' for a constrained number; '' otherwise."""
    if isinstance(t, mi.UnionType):
        return ", ".join(b for b in (bounds(x) for x in t.types) if b)
    parts = []
    for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        value = getattr(t, attr, None)
        if value is not None:
            parts.append(f"{sym} {value:g}" if isinstance(value, float) else f"{sym} {value}")
    return ", ".join(parts)
