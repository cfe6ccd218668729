"""A Kubernetes recipe's pods as processes on network-namespace hosts (tests/netns.py), with just enough of the
kubelet and the endpoints controller to test its readiness logic for real:

- each replica of each Deployment is a pod: a namespace host whose address is its POD_IP, running its
  container's command (with `$(VAR)` from its env: values and the downward API's podIP and metadata.name),
  started again when it exits (restartPolicy Always), with the kubelet's growing back-off;
- readiness probes run as the kubelet runs them: httpGet from outside the pod to POD_IP:port, exec inside
  the pod, each within its timeoutSeconds (the kubelet's 1 s when unset); a pod is Ready once its probe passed;
- every Service name resolves, inside every pod, to the pods it selects that are Ready, or to all of them
  with publishNotReadyAddresses: a hosts file bind-mounted over each pod's /etc/hosts, rewritten in place
  as readiness changes. A name with no endpoints does not resolve, as in a cluster.

Secrets, volumes and resource limits are left out: the pods here run on the CPU."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.netns import Hosts

#: the kubelet's restart back-off: 10 s doubling to 5 min; shortened here so a test sees several restarts
BACKOFF_S = (1.0, 2.0, 4.0, 8.0)
PROBE_EVERY_S = 1.0
#: a probe's timeout when the recipe sets none (timeoutSeconds): the kubelet's default
PROBE_TIMEOUT_S = 1.0


@dataclass
class Pod:
    name: str
    labels: dict
    container: dict
    host: int  # index in Hosts
    ip: str
    env: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    restarts: int = 0
    restart_at: float = 0.0
    ready: bool = False
    ready_at: float | None = None
    ready_round: int | None = None  # the probe round (every pod probed once, in order) it first passed in


class Cluster:
    def __init__(self, docs: list[dict], tmp: Path, bin_dir: Path, replicas: dict[str, int] | None = None):
        self.tmp, self.bin_dir = tmp, bin_dir
        deployments = [d for d in docs if d["kind"] == "Deployment"]
        self.services = [d for d in docs if d["kind"] == "Service"]
        counts = [(d, (replicas or {}).get(d["metadata"]["name"], d["spec"].get("replicas", 1))) for d in deployments]
        self.hosts = Hosts(sum(n for _, n in counts))
        self.hosts_file = tmp / "hosts"
        self.hosts_file.write_text("127.0.0.1 localhost\n")
        self.pods: list[Pod] = []
        for d, n in counts:
            template = d["spec"]["template"]
            for k in range(n):
                i = len(self.pods)
                pod = Pod(f"{d['metadata']['name']}-{k}", template["metadata"]["labels"],
                          template["spec"]["containers"][0], i, self.hosts.addr(i))
                pod.env = self._env(pod)
                self.pods.append(pod)
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    # --- pods --------------------------------------------------------------------------------------

    def _env(self, pod: Pod) -> dict:
        env = {}
        for e in pod.container.get("env", []):
            if "value" in e:
                env[e["name"]] = str(e["value"])
            elif "fieldRef" in e.get("valueFrom", {}):
                path = e["valueFrom"]["fieldRef"]["fieldPath"]
                env[e["name"]] = {"status.podIP": pod.ip, "metadata.name": pod.name}[path]
        return env

    def _expand(self, pod: Pod, args: list[str]) -> list[str]:
        return [re.sub(r"\$\((\w+)\)", lambda m: pod.env.get(m.group(1), m.group(0)), a) for a in args]

    def _in_pod(self, pod: Pod, argv: list[str]) -> list[str]:
        """argv run inside the pod: its namespace, hostname, private /dev/shm, and the cluster's names."""
        script = (f'mount -t tmpfs -o size=2g tmpfs /dev/shm && mount --bind {self.hosts_file} /etc/hosts && '
                  f'hostname {pod.name} && exec "$@"')
        return ["ip", "netns", "exec", self.hosts.names[pod.host], "unshare", "--mount", "--uts", "sh", "-c", script,
                "sh", *argv]

    def _pod_env(self, pod: Pod) -> dict:
        return {**os.environ, "PATH": f"{self.bin_dir}:{os.environ['PATH']}", **pod.env}

    def _start(self, pod: Pod) -> None:
        argv = self._expand(pod, [*pod.container.get("command", []), *pod.container.get("args", [])])
        log = open(self.tmp / f"{pod.name}.log", "a")
        log.write(f"--- start {pod.restarts} at {time.monotonic() - self.started:.1f} s: {' '.join(argv)}\n")
        log.flush()
        pod.proc = subprocess.Popen(self._in_pod(pod, argv), stdout=log, stderr=subprocess.STDOUT,
                                    env=self._pod_env(pod), start_new_session=True)

    def _probe(self, pod: Pod) -> bool:
        probe = pod.container.get("readinessProbe")
        if probe is None:
            return True
        if "httpGet" in probe:
            try:
                r = httpx.get(f"http://{pod.ip}:{probe['httpGet']['port']}{probe['httpGet']['path']}",
                              timeout=probe.get("timeoutSeconds", PROBE_TIMEOUT_S))
                return 200 <= r.status_code < 400
            except httpx.HTTPError:
                return False
        cmd = self._expand(pod, probe["exec"]["command"])
        try:
            res = subprocess.run(self._in_pod(pod, cmd), env=self._pod_env(pod), capture_output=True,
                                 timeout=probe.get("timeoutSeconds", PROBE_TIMEOUT_S))
        except subprocess.TimeoutExpired:  # the kubelet counts a probe past its timeout as failed
            return False
        return res.returncode == 0

    # --- services ------------------------------------------------------------------------------------

    def endpoints(self, service: str) -> list[Pod]:
        svc = next(s for s in self.services if s["metadata"]["name"] == service)
        selected = [p for p in self.pods if all(p.labels.get(k) == v for k, v in svc["spec"]["selector"].items())]
        if svc["spec"].get("publishNotReadyAddresses"):
            return [p for p in selected if p.proc is not None]
        return [p for p in selected if p.ready]

    def _write_hosts(self) -> None:
        lines = ["127.0.0.1 localhost"]
        for svc in self.services:
            lines += [f"{p.ip} {svc['metadata']['name']}" for p in self.endpoints(svc["metadata"]["name"])]
        text = "\n".join(lines) + "\n"
        with open(self.hosts_file, "r+") as f:  # in place: every pod's bind mount sees the same file
            if f.read() != text:
                f.seek(0)
                f.truncate()
                f.write(text)

    # --- the loop ------------------------------------------------------------------------------------

    def start(self) -> "Cluster":
        for pod in self.pods:
            self._start(pod)
        self._write_hosts()
        self._thread.start()
        return self

    def _run(self) -> None:
        rounds = 0
        while not self._stop.is_set():
            rounds += 1
            now = time.monotonic()
            for pod in self.pods:
                if pod.proc is not None and pod.proc.poll() is not None:  # exited: restart after a back-off
                    pod.proc, pod.ready = None, False
                    pod.restart_at = now + BACKOFF_S[min(pod.restarts, len(BACKOFF_S) - 1)]
                if pod.proc is None and now >= pod.restart_at:
                    pod.restarts += 1
                    self._start(pod)
                if pod.proc is not None:
                    ready = self._probe(pod)
                    if ready and pod.ready_at is None:
                        pod.ready_at, pod.ready_round = time.monotonic() - self.started, rounds
                    pod.ready = ready
            self._write_hosts()
            self._stop.wait(PROBE_EVERY_S)

    def log(self, pod: Pod) -> str:
        return (self.tmp / f"{pod.name}.log").read_text()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)
        for pod in self.pods:
            if pod.proc is not None and pod.proc.poll() is None:
                os.killpg(pod.proc.pid, signal.SIGTERM)
        for pod in self.pods:
            if pod.proc is not None:
                try:
                    pod.proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(pod.proc.pid, signal.SIGKILL)
        self.hosts.close()
