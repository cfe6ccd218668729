"""Click options made from the settings schema: every flag of `launch` (and serve-http's three) comes from a
field of disagg/settings/schema.py, with its help, bounds and default, and maps back to that field's path."""

from __future__ import annotations

import click
import msgspec.inspect as mi

from disagg.launcher.cli.common import int_list
from disagg.settings.fields import Leaf, by_path, choices, leaves
from disagg.settings.render import value_text
from disagg.settings.schema import ROLE_SECTIONS

PRECEDENCE = "Precedence: a flag over its DISAGG_<NAME> variable over the --config file over the defaults."


def _click_type(t):
    if isinstance(t, (mi.LiteralType, mi.EnumType)):
        return click.Choice([v for v in choices(t) if v != ""] or [""])
    if isinstance(t, mi.IntType):
        lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else None)
        return click.IntRange(lo, t.le if t.le is not None else (t.lt - 1 if t.lt is not None else None))
    if isinstance(t, mi.FloatType):
        return click.FloatRange(t.ge if t.ge is not None else t.gt, t.le, min_open=t.ge is None and t.gt is not None)
    return str  # strings, and lists written 0,1,2 (parsed by _list)


def _dest(path: str) -> str:
    return "set__" + path.replace(".", "__")


def _help(leaf_list: list[Leaf], prefix: str = "") -> str:
    leaf = leaf_list[0]
    keys = ", ".join(x.path for x in leaf_list)
    envs = ", ".join(x.env for x in leaf_list)
    default = ",".join(value_text(x.default) for x in leaf_list)
    return f"{prefix}{leaf.short_help} [default {default}; config {keys}; env {envs}]"


def _grouped() -> dict[str, list[Leaf]]:
    """flag -> the leaves it sets (one, or one per role section for --capacity E,D,K)."""
    out: dict[str, list[Leaf]] = {}
    for leaf in leaves():
        if leaf.flag:
            out.setdefault(leaf.flag, []).append(leaf)
    return out


def settings_options(rename: dict[str, str] | None = None, only: tuple[str, ...] | None = None):
    """A decorator adding one option per schema flag (`only`: these paths; `rename`: path -> flag)."""
    rename = rename or {}

    def decorate(command):
        options = []
        for flag, group in _grouped().items():
            if only is not None and group[0].path not in only:
                continue
            leaf = group[0]
            prefix = f"{leaf.section}: " if leaf.section and len(group) == 1 else ""
            flag = rename.get(leaf.path, flag)
            names = flag.split("/")
            if len(group) > 1:  # E,D,K
                options.append(click.option(names[0], _dest(names[0].lstrip("-")), metavar="E,D,K", help=_help(group)))
            elif leaf.is_flag:
                options.append(click.option(flag, _dest(leaf.path), default=None, help=_help(group, prefix)))
            else:
                metavar = leaf.metavar or None
                options.append(click.option(*names, _dest(leaf.path), type=_click_type(leaf.type), metavar=metavar,
                                            help=_help(group, prefix)))
        if only is None:  # the per-role members of gpus_per
            gp = by_path()["gpus_per"]
            for role in ROLE_SECTIONS:
                options.append(click.option(f"--gpus-per-{role}", _dest(f"gpus_per.{role}"), type=click.IntRange(1, 64),
                                            help=f"GPUs (ranks) per {role} instance [config gpus_per.{role}; env "
                                                 f"{gp.env}]" + (": " + gp.short_help if role == "denoiser" else "")))
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def flags_from(kwargs: dict) -> dict[str, object]:
    """{setting path: value} of the schema flags a command was given (the rest of kwargs is left alone)."""
    flat: dict[str, object] = {}
    for flag, group in _grouped().items():
        if len(group) > 1:
            value = kwargs.pop(_dest(flag.split("/")[0].lstrip("-")), None)
            if value is not None:
                for leaf, item in zip(group, int_list(value, flag, len(group))):
                    flat[leaf.path] = item
            continue
        leaf = group[0]
        value = kwargs.pop(_dest(leaf.path), None)
        if value is None:
            continue
        if isinstance(leaf.type, mi.ListType):
            value = int_list(value, flag)
        flat[leaf.path] = value
    per = {role: kwargs.pop(_dest(f"gpus_per.{role}"), None) for role in ROLE_SECTIONS}
    if any(v is not None for v in per.values()):
        flat["gpus_per"] = {role: v for role, v in per.items() if v is not None}
    return flat


def file_only_epilog() -> str:
    """`launch --help`'s list of the settings that have no flag of their own."""
    names = [leaf.path for leaf in leaves() if not leaf.flag and not leaf.path.startswith("gpus_per")]
    return ("Settings without a flag (config file or DISAGG_<NAME>): " + ", ".join(names) + ". " + PRECEDENCE +
            " Every setting, with its help: configs/tiny.yaml.")
