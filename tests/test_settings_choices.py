"""Choice-valued settings are enums, declared once (issue 45, settings): the code dispatches on their members,
never on spelled strings; constructors that take a setting default to the schema's value; the users' spelling
(files, DISAGG_ variables, flags, the settings JSON a process decodes) is the enum's value."""

from __future__ import annotations

import enum
import inspect
import re

import msgspec
import msgspec.inspect as mi

from disagg.settings.fields import leaves
from disagg.settings.process import OrchestratorSettings, RoleSettings, decode, encode
from disagg.settings.schema import Settings
from disagg.settings.sources import resolve
from disagg.transport.wire.choice import Choice
from tests.conftest import ROOT


def _choice_types(t):
    if isinstance(t, mi.UnionType):
        return [x for u in t.types for x in _choice_types(u)]
    if isinstance(t, mi.DictType):
        return _choice_types(t.key_type) + _choice_types(t.value_type)
    if isinstance(t, mi.ListType):
        return _choice_types(t.item_type)
    return [t] if isinstance(t, (mi.LiteralType, mi.EnumType)) else []


def _enums() -> list[type[Choice]]:
    return [t.cls for leaf in leaves() for t in _choice_types(leaf.type) if isinstance(t, mi.EnumType)]


def test_every_choice_valued_setting_is_an_enum_spelled_as_before():
    for leaf in leaves():
        for t in _choice_types(leaf.type):
            assert isinstance(t, mi.EnumType) and issubclass(t.cls, Choice), f"{leaf.path}: {t} is not a Choice enum"
    assert {e.__name__ for e in _enums()} >= {"Schedule", "Admission", "Dispatch", "Transfer", "LoraAffinity",
                                              "RebalanceMode", "CompileMode", "CompileScope", "Dtype"}
    s = Settings()
    # a member is its string: equal, printed, encoded (JSON and YAML documents spell the value)
    assert s.schedule.order == "slo" and f"{s.schedule.order}" == "slo" and str(s.loras.affinity) == "auto"
    assert msgspec.json.decode(msgspec.json.encode(s))["rebalance"]["mode"] == "advise"


def test_choices_decode_from_file_env_and_the_process_json(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("schedule: fifo\nloras: {affinity: two-choices}\n")
    got = resolve(cfg, environ={"DISAGG_REBALANCE_MODE": "auto", "DISAGG_COMPILE_MODE": "reduce-overhead"}).settings
    assert type(got.schedule.order).__name__ == "Schedule" and got.schedule.order == "fifo"  # the older `schedule: fifo`
    assert got.loras.affinity.name == "TWO_CHOICES" and got.rebalance.mode.name == "AUTO"
    assert got.compile.mode.cuda_graphs
    orch = OrchestratorSettings(**{k: getattr(got, k) for k in ("schedule", "admission", "dispatch")})
    back = decode(encode(orch), OrchestratorSettings)
    assert back.schedule.order is got.schedule.order and isinstance(back.dispatch, enum.Enum)
    assert '"order":"fifo"' in encode(orch)
    role = decode(encode(RoleSettings(role="denoiser", instance_id="d", endpoint="e")), RoleSettings)
    assert role.compile.scope.name == "BLOCKS"


def test_constructors_that_take_a_setting_default_to_the_schemas_value():
    from disagg.roles.batcher import StepBatcher
    from disagg.roles.stage import Stage
    from disagg.roles.turns import Turns

    s = Settings()
    for fn in (Stage.__init__, StepBatcher.__init__):
        params = inspect.signature(fn).parameters
        assert params["schedule"].default == s.schedule.order, fn.__qualname__
        assert params["aging_s"].default == s.schedule.aging_s, fn.__qualname__
    assert inspect.signature(Turns.__init__).parameters["aging_s"].default == s.schedule.aging_s
    from disagg.orchestrator.scheduling.loras import (
        pick_by_affinity,  # the rule is the caller's setting, no default of its own
    )

    assert inspect.signature(pick_by_affinity).parameters["rule"].default is inspect.Parameter.empty


def test_no_setting_value_is_compared_as_a_spelled_string():
    """`x == "slo"`, `x in ("auto", ...)`: the code compares with the enum's member (Schedule.SLO) instead, so a
    value is spelled once, in disagg/settings/choices.py (and transport/selection.py's engines)."""
    # a role's name is the wire's identity of an instance and a stage (every message carries it), not only the key
    # of parallel and gpus_per: it is compared as such
    values = {m.value for e in _enums() if e.__name__ != "Role" for m in e if m.value} | {"strict"}
    values = sorted(values, key=len, reverse=True)
    spelled = "|".join(re.escape(v) for v in values)
    compare = re.compile(rf"""(?:[=!]=\s*["']({spelled})["'])|(?:["']({spelled})["']\s*[=!]=)|"""
                         rf"""(?:\bin\s*\([^)]*["']({spelled})["'])""")
    #: spellings that are not settings' values
    not_settings = {"disagg/gateway/fields.py": 'size in (None, "auto")'}  # the OpenAI request's size: auto
    found = []
    for path in sorted((ROOT / "disagg").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            allowed = not_settings.get(str(path.relative_to(ROOT)))
            if compare.search(code) and (allowed is None or allowed not in code):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_compile_settings_are_a_section_and_their_older_names_still_work(tmp_path):
    """compile, compile_mode, compile_scope, compile_sizes, compile_cache_dir became the compile section; a config
    file and DISAGG_COMPILE still take the older names (a warning names the new one), the flags are as they were."""
    from tests.conftest import disagg
    from tests.test_settings import clean_env, print_config

    cfg = tmp_path / "old.yaml"
    cfg.write_text("compile: true\ncompile_mode: max-autotune\ncompile_sizes: [64x64]\ncompile_cache_dir: /tmp/x\n")
    res = resolve(cfg, environ={})
    c = res.settings.compile
    assert (c.enabled, c.mode, c.sizes, c.cache_dir) == (True, "max-autotune", ["64x64"], "/tmp/x")
    assert f"config {cfg}: compile_mode is now compile.mode" in res.warnings
    assert f"config {cfg}: compile is now compile.enabled" in res.warnings
    # the new spelling, without a warning; a section key that is not a mapping is still refused
    new = tmp_path / "new.yaml"
    new.write_text("compile: {enabled: true, scope: model}\n")
    res = resolve(new, environ={})
    assert res.settings.compile.enabled and res.settings.compile.scope == "model" and not res.warnings
    old_env = resolve(environ={"DISAGG_COMPILE": "true", "DISAGG_COMPILE_MODE": "reduce-overhead"})
    assert old_env.settings.compile.enabled and old_env.settings.compile.mode == "reduce-overhead"
    assert old_env.warnings == ["DISAGG_COMPILE is now DISAGG_COMPILE_ENABLED"]
    got = print_config("--compile", "--compile-mode", "max-autotune", "--compile-scope", "model",
                       env=clean_env(DISAGG_COMPILE_CACHE_DIR="/tmp/y"))
    assert got["compile.enabled"] == ("true", "flag --compile/--no-compile")
    assert got["compile.mode"] == ("max-autotune", "flag --compile-mode")
    assert got["compile.scope"][0] == "model" and got["compile.cache_dir"] == ("/tmp/y", "env DISAGG_COMPILE_CACHE_DIR")
    res = disagg("launch", "--config", str(cfg), "--print-config", env=clean_env(), timeout=30)
    assert res.returncode == 0 and "compile_sizes is now compile.sizes" in res.stderr, res.stderr


def test_the_busy_poll_settings_are_a_section_and_their_older_names_still_work(tmp_path):
    cfg = tmp_path / "old.yaml"
    cfg.write_text("busy_poll: 0.001\nbusy_poll_max_in_flight: 9\n")
    res = resolve(cfg, environ={})
    assert (res.settings.busy_poll.seconds, res.settings.busy_poll.max_in_flight) == (0.001, 9)
    assert f"config {cfg}: busy_poll is now busy_poll.seconds" in res.warnings
    res = resolve(environ={"DISAGG_BUSY_POLL": "0"})
    assert res.settings.busy_poll.seconds == 0 and res.warnings == ["DISAGG_BUSY_POLL is now DISAGG_BUSY_POLL_SECONDS"]
    from tests.test_settings import clean_env, print_config

    got = print_config("--busy-poll", "0.002", "--busy-poll-max-in-flight", "7", env=clean_env())
    assert got["busy_poll.seconds"] == ("0.002", "flag --busy-poll") and got["busy_poll.max_in_flight"][0] == "7"
    assert OrchestratorSettings().busy_poll == Settings().busy_poll  # through the schema's use(), whole
