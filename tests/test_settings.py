"""One settings schema (issue 23): every form of a setting comes from disagg/settings/schema.py; precedence is flag over
DISAGG_ variable over config file over default, seen in `--print-config` and in the process that reads it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import msgspec
import pytest

from disagg.settings.fields import leaves
from disagg.settings.render import readme_table, tiny_yaml
from tests.conftest import ROOT, Launched, disagg, free_port_pair, wait_until


def clean_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    return {**env, **extra}


def print_config(*args, env=None) -> dict[str, tuple[str, str]]:
    """path -> (value text, origin) from `disagg launch --print-config ARGS`."""
    res = disagg("launch", "--print-config", *args, env=env or clean_env(), timeout=60)
    assert res.returncode == 0, res.stderr
    out, section = {}, ""
    for line in res.stdout.splitlines():
        if not line.startswith(" ") and line.endswith(":"):
            section = line[:-1]
            continue
        key, _, rest = line.strip().partition(": ")
        value, _, origin = rest.partition("  # ")
        out[f"{section}.{key}" if line.startswith(" ") else key] = (value, origin)
    return out


def test_tiny_yaml_is_generated_from_the_schema_and_current():
    assert (ROOT / "configs" / "tiny.yaml").read_text() == tiny_yaml(), "run: python -m disagg.settings yaml > configs/tiny.yaml"
    text = tiny_yaml()
    for leaf in leaves():
        name = leaf.path.rpartition(".")[2]
        assert re.search(rf"^\s*{name}: ", text, re.M), leaf.path
        assert leaf.env in text


def test_every_setting_is_in_launch_help_and_the_settings_guide():
    res = disagg("launch", "--help", timeout=30)
    helptext = " ".join(res.stdout.split())
    for leaf in leaves():
        assert leaf.path in helptext, f"{leaf.path} not in launch --help"
    guide = (ROOT / "docs" / "guide" / "settings.md").read_text()
    assert readme_table() in guide, "docs/guide/settings.md's table is not current: python -m disagg.settings table"


def test_the_schema_names_what_the_code_implements():
    from disagg.orchestrator.scheduling.dispatch import POLICIES
    from disagg.settings.schema import DISPATCH_POLICIES, TRANSFERS
    from disagg.transport.data.selection import CHOICES

    assert sorted(DISPATCH_POLICIES) == sorted(POLICIES)
    assert sorted(TRANSFERS) == sorted(CHOICES)


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_queue: 11\ndtype: float16\nhttp: {image_ttl: 11}\n")
    got = print_config("--config", str(cfg))
    assert got["max_queue"] == ("11", "file") and got["dtype"] == ("float16", "file")
    assert got["http.image_ttl"] == ("11.0", "file") and got["timeouts.request"] == ("600.0", "default")
    env = clean_env(DISAGG_MAX_QUEUE="22", DISAGG_DTYPE="bfloat16", DISAGG_HTTP_IMAGE_TTL="22")
    got = print_config("--config", str(cfg), env=env)
    assert got["max_queue"] == ("22", "env DISAGG_MAX_QUEUE") and got["dtype"] == ("bfloat16", "env DISAGG_DTYPE")
    assert got["http.image_ttl"] == ("22.0", "env DISAGG_HTTP_IMAGE_TTL")
    got = print_config("--config", str(cfg), "--max-queue", "33", "--dtype", "float32", env=env)
    assert got["max_queue"] == ("33", "flag --max-queue") and got["dtype"] == ("float32", "flag --dtype")


def settings_logged(log_path) -> dict:
    """The settings a process logged at start ("settings: {json}")."""
    text = log_path.read_text()
    m = re.search(r"settings: (\{.*\})$", text, re.M)
    assert m, text[-2000:]
    return json.loads(m.group(1))


@pytest.mark.e2e
@pytest.mark.parametrize("layers", ["file", "flag"])
def test_each_process_runs_with_the_winning_value(layers, tmp_path):
    """One setting per process kind (orchestrator: max_queue; role: dtype; gateway: http.image_ttl), set in the
    file, then also in the environment and as a flag: the process logs the winner's value (the environment's
    over the file's: image_ttl, which has no flag; every layer's order: tests above, in this process)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: payload\nmax_queue: 11\ndtype: float16\nhttp: {image_ttl: 11}\n")
    env = clean_env()
    want, flags = (11, "float16", 11.0), []
    if layers == "flag":
        env.update(DISAGG_MAX_QUEUE="22", DISAGG_DTYPE="bfloat16", DISAGG_HTTP_IMAGE_TTL="22")
        flags = ["--max-queue", "33", "--dtype", "float32"]
        want = (33, "float32", 22.0)  # image_ttl has no flag: its variable still wins over the file
    http = free_port_pair()
    dep = Launched(["--config", str(cfg), "-e", "1", "-d", "0", "-k", "0", "--http-port", str(http),
                    "--no-dashboard", *flags], tmp_path, env=env)
    try:
        logs = tmp_path / "run" / "logs"
        wait_until(lambda: (logs / "encoder-0.log").exists() and "settings:" in (logs / "encoder-0.log").read_text()
                   and (logs / "gateway.log").exists() and "settings:" in (logs / "gateway.log").read_text(),
                   timeout=120, why=dep.output)
        assert settings_logged(logs / "orchestrator.log")["max_queue"] == want[0]
        assert settings_logged(logs / "encoder-0.log")["dtype"] == want[1]
        assert settings_logged(logs / "gateway.log")["http"]["image_ttl"] == want[2]
    finally:
        dep.stop()


def test_a_model_flag_with_a_layout_in_the_file_is_checked_against_that_model(tmp_path):
    """The reported case: the file's layout was checked against the default model before --model was merged."""
    from tests.checkpoints import save_tiny

    save_tiny("sd3", tmp_path / "sd3")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("parallel:\n  denoiser: {cfg: 2}\n")
    got = print_config("--model", str(tmp_path / "sd3"), "--config", str(cfg), "-d", "1")
    assert got["parallel"] == ("{denoiser: {cfg: 2, ring: 1, ulysses: 1}}", "file")


@pytest.mark.parametrize("content,says", [
    ("heartbeat_timout: 3\n", "unknown key heartbeat_timout (did you mean timeouts.heartbeat?)"),
    ("denoisers: {cout: 2}\n", "unknown key denoisers.cout (did you mean denoisers.count?)"),
    ("http: {prot: 80}\n", "unknown key http.prot (did you mean http.port?)"),
    ("port: 99999\n", "port (from config"),
])
def test_an_unknown_or_bad_key_exits_2_naming_it(content, says, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(content)
    res = disagg("launch", "--config", str(cfg), "--print-config", env=clean_env(), timeout=30)
    assert res.returncode == 2 and says in res.stderr, res.stderr


def test_an_unknown_variable_exits_2_naming_the_closest():
    res = disagg("launch", "--print-config", env=clean_env(DISAGG_HEARTBEAT_TIMOUT="3"), timeout=30)
    assert res.returncode == 2 and "DISAGG_HEARTBEAT_TIMOUT" in res.stderr, res.stderr
    res = disagg("launch", "--print-config", env=clean_env(DISAGG_DENOISERS_COUNT="x"), timeout=30)
    assert res.returncode == 2 and "denoisers.count (from DISAGG_DENOISERS_COUNT)" in res.stderr, res.stderr


def test_an_older_key_still_works_with_a_warning_naming_the_new_one(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("heartbeat_timeout_s: 4.0\n")
    res = disagg("launch", "--config", str(cfg), "--print-config", env=clean_env(), timeout=30)
    assert res.returncode == 0, res.stderr
    assert "timeouts:" in res.stdout and "  heartbeat: 4.0  # file" in res.stdout
    assert "heartbeat_timeout_s is now timeouts.heartbeat" in res.stderr


def test_a_process_refuses_settings_with_an_unknown_key():
    from disagg.settings.process import RoleSettings, encode

    spec = json.loads(encode(RoleSettings(role="encoder", instance_id="encoder-0", endpoint="tcp://127.0.0.1:1")))
    res = subprocess.run([sys.executable, "-m", "disagg.roles", json.dumps({**spec, "colour": "red"})], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    from disagg.transport.wire.messages import BOOT_ERROR_EXIT

    assert res.returncode == BOOT_ERROR_EXIT and "unknown field `colour`" in res.stderr, res.stderr
    with pytest.raises(msgspec.ValidationError, match="bogus"):
        msgspec.json.decode(b'{"endpoint": "tcp://x:1", "bogus": 1}', type=__import__(
            "disagg.settings.process", fromlist=["GatewaySettings"]).GatewaySettings)
