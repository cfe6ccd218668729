"""Where settings come from, merged once: flag over environment (DISAGG_<NAME>) over config file over default.

`resolve()` takes the three sources as plain values, overlays them leaf by leaf, converts the result to a
`Settings` (types and bounds: a `SettingsError` naming the key and where its value came from) and returns it
with each leaf's origin. The cross-field checks (layout against model and so on) run on that merged result,
in the launcher (disagg/launcher/topology.py validate), once.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import msgspec
import msgspec.inspect as mi
import yaml

from disagg.settings.fields import ENV_PREFIX, by_path, leaves, sections
from disagg.settings.schema import Settings
from disagg.transport.environment import DISAGG_API_KEY, DISAGG_HTTP_API_KEY, NOT_SETTINGS


class SettingsError(ValueError):
    """A setting that cannot be: an unknown key or variable, a wrong type, a value out of bounds."""


#: DISAGG_ variables that are not settings: what a process's launcher tells it, what clients and recipes read
#: (declared in disagg/transport/environment.py)
OTHER_VARIABLES = NOT_SETTINGS

ORIGINS = ("default", "file", "env", "flag")


@dataclass
class Resolved:
    settings: Settings
    #: leaf path -> "default" | "file" | "env" | "flag"
    origins: dict[str, str] = field(default_factory=dict)
    #: older names seen, as warnings to show ("heartbeat_timeout is now timeouts.heartbeat")
    warnings: list[str] = field(default_factory=list)


def closest(name: str, known, older: dict[str, str] | None = None) -> str:
    """' (did you mean X?)' for the nearest known name, or ''; `older`: older name -> its setting now (a typo of
    an older name is told the new one)."""
    older = older or {}
    match = difflib.get_close_matches(name, [*known, *older], n=1, cutoff=0.5)
    return f" (did you mean {older.get(match[0], match[0])}?)" if match else ""


def read_file(path: str | Path) -> dict:
    """A config file's YAML mapping (not yet checked against the schema)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise SettingsError(f"cannot read config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise SettingsError(f"config {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"config {path}: expected a mapping of settings, got a YAML {type(data).__name__}")
    return data


def flatten_file(data: dict, where: str, notes: list[str]) -> dict[str, object]:
    """{leaf path: value} of a config file's mapping; unknown keys are refused naming the closest, older
    names are taken with a note naming the new one."""
    known = by_path()
    legacy = {old: leaf.path for leaf in leaves() for old in leaf.legacy}
    out: dict[str, object] = {}

    def put(path: str, value) -> None:
        if path in legacy:
            notes.append(f"{where}: {path} is now {legacy[path]}")
            path = legacy[path]
        if path not in known:
            raise SettingsError(f"{where}: unknown key {path}{closest(path, [*known, *sections()], legacy)}")
        out[path] = value

    for key, value in data.items():
        key = str(key)
        if key in sections() and not (key in legacy and not isinstance(value, dict)):  # `compile: true` is older
            if not isinstance(value, dict):
                raise SettingsError(f"{where}: {key}: expected a mapping, got {value!r}")
            for sub, v in value.items():
                put(f"{key}.{sub}", v)
        else:
            put(key, value)
    return out


def _env_value(leaf, raw: str):
    """A variable's text as the leaf's type wants it: strings as they are, numbers and booleans and lists
    and maps as YAML (a list of ints may also be written 0,1,2)."""
    t = leaf.type
    if isinstance(t, mi.UnionType):  # X | None: "null" or "" is None
        if raw.strip().lower() in ("", "null", "none"):
            return None
        t = next(x for x in t.types if not isinstance(x, mi.NoneType))
    if isinstance(t, (mi.StrType, mi.LiteralType, mi.EnumType)):
        return raw
    if isinstance(t, mi.ListType) and re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*|\s*", raw):
        return [int(x) for x in raw.split(",") if x.strip()]
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise SettingsError(f"{leaf.env}={raw!r}: not a valid value ({exc})") from None


def check_variables(environ: Mapping[str, str]) -> None:
    """Refuse a DISAGG_ variable that is neither a setting nor in OTHER_VARIABLES (a typo would otherwise be
    ignored in silence), naming the closest known name. `launch` checks through from_environment; the client
    commands (status, submit, stop, bench, serve-http), which read few settings, call this."""
    by_env = {leaf.env for leaf in leaves()} | {env for leaf in leaves() for env in leaf.legacy_envs}
    for name in environ:
        if name.startswith(ENV_PREFIX) and name not in by_env and name not in OTHER_VARIABLES:
            raise SettingsError(f"unknown variable {name}{closest(name, [*by_env, *OTHER_VARIABLES])}: not a "
                                "disagg setting (unset it, or see `disagg launch --help` for the DISAGG_ names)")


def from_environment(environ: Mapping[str, str], notes: list[str]) -> dict[str, object]:
    """{leaf path: value} of the DISAGG_ variables; one that is neither a setting nor in OTHER_VARIABLES is
    refused, naming the closest known name (check_variables)."""
    check_variables(environ)
    by_env = {leaf.env: leaf for leaf in leaves()}
    by_legacy_env = {env: leaf for leaf in leaves() for env in leaf.legacy_envs}
    out: dict[str, object] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        if name in by_env:
            out[by_env[name].path] = _env_value(by_env[name], raw)
        elif name in by_legacy_env:
            leaf = by_legacy_env[name]
            if leaf.env not in environ:  # the new name wins
                notes.append(f"{name} is now {leaf.env}")
                out[leaf.path] = _env_value(leaf, raw)
        elif name == DISAGG_API_KEY:
            if DISAGG_HTTP_API_KEY not in environ:
                notes.append("DISAGG_API_KEY is now DISAGG_HTTP_API_KEY")
                out["http.api_key"] = raw
    return out


def _nest(flat: Mapping[str, object]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        section, _, name = path.rpartition(".")
        (out.setdefault(section, {}) if section else out)[name] = value
    return out


def resolve(file: str | Path | None = None, environ: Mapping[str, str] | None = None,
            flags: Mapping[str, object] | None = None) -> Resolved:
    """The effective settings: `flags` ({leaf path: value}, None values left out) over `environ`'s DISAGG_
    variables (default: os.environ) over the config `file` over the defaults."""
    notes: list[str] = []
    layers = {
        "file": flatten_file(read_file(file), f"config {file}", notes) if file else {},
        "env": from_environment(os.environ if environ is None else environ, notes),
        "flag": {k: v for k, v in (flags or {}).items() if v is not None},
    }
    unknown = [k for k in layers["flag"] if k not in by_path()]
    assert not unknown, f"flags for no setting: {unknown}"  # a programming error: flags come from the schema
    merged = msgspec.to_builtins(Settings())
    origins = {leaf.path: "default" for leaf in leaves()}
    for origin, flat in layers.items():
        for path, value in flat.items():
            section, _, name = path.rpartition(".")
            into = merged[section] if section else merged
            if isinstance(value, dict) and isinstance(into.get(name), dict):  # maps merge: --gpus-per-denoiser
                value = {**into[name], **value}                                # keeps the file's other roles
            into[name] = value
            origins[path] = origin
    try:
        settings = msgspec.convert(merged, Settings)
    except msgspec.ValidationError as exc:
        raise SettingsError(_where(str(exc), origins, file)) from None
    return Resolved(settings, origins, notes)


def _where(message: str, origins: dict[str, str], file) -> str:
    """A conversion error with the key it is about and where that key's value came from."""
    m = re.search(r"at `\$\.([A-Za-z_]+)(?:\.([A-Za-z_]+))?", message)
    if not m:
        return message
    path = m.group(1) if m.group(1) in by_path() or not m.group(2) else f"{m.group(1)}.{m.group(2)}"
    leaf = by_path().get(path)
    if leaf is None:
        return message
    origin = origins.get(path, "default")
    source = {"file": f"config {file}", "env": leaf.env, "flag": leaf.flag or "a flag", "default": "the default"}[origin]
    return f"{path} (from {source}): {message.split(' - at ')[0]}"

