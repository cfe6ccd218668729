"""The cluster recipes in deploy/: the Slurm script runs (its steps started as network-namespace hosts by
stub `srun` / `scontrol` commands) and serves; every command in the Kubernetes YAML is one the CLI accepts."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from client import Client, Unreachable
from launcher.cli import cli
from launcher.ports import free_port_pair
from tests import netns
from tests.conftest import wait_until
from transport.messages import GenerationParams

ROOT = Path(__file__).resolve().parent.parent

# srun as the sbatch script uses it: -w NODE / --exclude=NODE / --nodes=N, then a command, run on each
# chosen node (a network-namespace host) at once; the step's status is the worst of theirs
SRUN = r'''#!PYTHON
import os, subprocess, sys
nodes = os.environ["STUB_NODES"].split(",")
args, chosen, exclude = sys.argv[1:], None, set()
while args and args[0].startswith("-"):
    a = args.pop(0)
    if a == "-w":
        chosen = [args.pop(0)]
    elif a.startswith("--exclude="):
        exclude = set(a.split("=", 1)[1].split(","))
    elif a in ("--nodes", "--ntasks", "--ntasks-per-node"):
        args.pop(0)
chosen = [n for n in (chosen or nodes) if n not in exclude]
script = 'mount -t tmpfs -o size=2g tmpfs /dev/shm && hostname "$0" && exec "$@"'
procs = [subprocess.Popen(["ip", "netns", "exec", n, "unshare", "--mount", "--uts", "sh", "-c", script, n, *args])
         for n in chosen]
sys.exit(max(p.wait() for p in procs))
'''
SCONTROL = '#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && echo "$STUB_NODES" | tr , "\\n"\n'


@pytest.mark.e2e
@pytest.mark.skipif(bool(netns.available()), reason=netns.available() or "")
def test_the_sbatch_script_runs_a_head_and_join_nodes_under_stub_slurm(tmp_path):
    hosts = netns.Hosts(3)
    proc = None
    try:
        stubs = tmp_path / "bin"
        stubs.mkdir()
        (stubs / "srun").write_text(SRUN.replace("PYTHON", sys.executable))
        (stubs / "scontrol").write_text(SCONTROL)
        disagg = stubs / "disagg"  # the CLI as installed on the nodes
        disagg.write_text(f'#!/bin/sh\nexec {sys.executable} -m launcher "$@"\n')
        for f in stubs.iterdir():
            f.chmod(f.stat().st_mode | stat.S_IXUSR)
        port, http_port = free_port_pair(), free_port_pair()
        env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
               "SLURM_JOB_NODELIST": "ignored", "STUB_NODES": ",".join(hosts.names), "DISAGG_PORT": str(port),
               "DISAGG_HTTP_PORT": str(http_port), "DISAGG_HEAD_ROLES": "-e 1 -d 0 -k 1 --spares 0"}
        log = open(tmp_path / "sbatch.log", "w")
        proc = subprocess.Popen(["bash", str(ROOT / "deploy/slurm/disagg.sbatch")], env=env, cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        head = f"tcp://{hosts.addr(0)}:{port}"

        def ready():
            try:
                with Client(head) as client:
                    r = client.status(timeout_s=2)
            except (Unreachable, RuntimeError):
                return None
            return sum(i.state == "ready" for i in r.instances) >= 4 and r
        report = wait_until(ready, timeout=240, step=1)
        assert len({i.host for i in report.instances}) == 3  # the head node and two join nodes
        assert sorted(i.role for i in report.instances) == ["decoder", "denoiser", "denoiser", "encoder"]
        with Client(head) as client:
            outcomes = client.run_all([GenerationParams(prompt=f"slurm {i}", width=64, height=64, num_inference_steps=2,
                                                        seed=i) for i in range(4)], concurrency=2)
        assert all(o.ok for o in outcomes), [o.error for o in outcomes]
        res = subprocess.run([sys.executable, "-m", "launcher", "stop", "--endpoint", head], capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert proc.wait(90) == 0, (tmp_path / "sbatch.log").read_text()[-3000:]
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, 9)
        hosts.close()


def container_commands(doc) -> list[list[str]]:
    """Every command a pod of this manifest runs: containers' command + args, and exec probes."""
    found = []
    spec = (doc.get("spec") or {}).get("template", {}).get("spec", {})
    for c in spec.get("containers", []):
        found.append([*c.get("command", []), *c.get("args", [])])
        for probe in ("readinessProbe", "livenessProbe"):
            cmd = (c.get(probe) or {}).get("exec", {}).get("command")
            if cmd:
                found.append(cmd)
    return found


def test_every_command_in_the_kubernetes_yaml_is_one_the_cli_accepts():
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy/k8s/disagg.yaml").read_text()) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Deployment", "Deployment", "Service"]
    commands = [c for d in docs for c in container_commands(d)]
    assert len(commands) >= 3
    for argv in commands:
        assert argv[0] == "disagg", argv
        ctx = cli.make_context("disagg", list(argv[1:]))
        name, cmd, rest = cli.resolve_command(ctx, list(argv[1:]))
        cmd.make_context(name, rest, parent=ctx)  # raises on an unknown option or a bad value
    heads = [c for c in commands if "--join" not in c and c[1] == "launch"]
    joins = [c for c in commands if "--join" in c]
    assert heads and joins and all("$(POD_IP)" in c for c in heads + joins)
    # the join target is the head's Service
    service = next(d for d in docs if d["kind"] == "Service")
    assert all(c[c.index("--join") + 1] == f"tcp://{service['metadata']['name']}:5555" for c in joins)


def test_the_sbatch_script_is_valid_bash():
    res = subprocess.run(["bash", "-n", str(ROOT / "deploy/slurm/disagg.sbatch")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
