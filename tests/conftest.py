"""Shared helpers: free ports and real deployments started through the `disagg` CLI."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from disagg.launcher.ports import free_port_pair  # noqa: F401 - tests import it from here
from disagg.transport.data.shm import pid_alive  # noqa: F401 - likewise

ROOT = Path(__file__).resolve().parent.parent
#: the compiled deployments' inductor cache (compile_cache_dir), shared by the tests that compile tiny at 64x64
#: (tests/test_compile.py, the GPU script's dry run): the second of them finds the first's kernels
COMPILE_CACHE = Path("/tmp") / f"disagg-tests-inductor-{os.getuid()}"


#: the xdist group of the tests that take a shared tiny-checkpoint deployment (`checkpoint`): one worker runs
#: them all, so each checkpoint is launched once per run, whichever modules its tests are in
CHECKPOINTS_GROUP = "checkpoints"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """With pytest-xdist (`--dist loadgroup`, pyproject's addopts): a module's tests stay on one worker, as they
    share its deployment (group = the module), but for the tests of shared checkpoint deployments (group
    `checkpoints`), which cross modules. Before xdist reads the groups: this hook runs first."""
    for item in items:
        if not any(True for _ in item.iter_markers("xdist_group")):
            group = CHECKPOINTS_GROUP if "checkpoint" in item.fixturenames else item.module.__name__
            item.add_marker(pytest.mark.xdist_group(group))


#: the groups that take longest, longest first, handed out first (`--no-loadscope-reorder`: xdist gives groups out
#: in collection order, to whichever worker has fewest left), so the two workers end together (`--durations`)
FIRST = (CHECKPOINTS_GROUP, "tests.test_gpu_check", "tests.test_parallel", "tests.test_deploy", "tests.test_multihost",
         "tests.test_launch", "tests.test_failures", "tests.test_submit_outputs", "tests.test_chaos_day",
         "tests.test_engines_e2e",
         "tests.test_loras", "tests.test_demo", "tests.test_gateway", "tests.test_collisions",
         "tests.test_cli_errors_and_cleanup", "tests.test_standby", "tests.test_settings")


class _Order:
    """The order of the tests, after pytest's own (which groups tests by their higher-scoped fixtures' parameters)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        order_ends_deployment(items)

        kinds: dict[str, int] = {}  # each checkpoint's tests together, whichever module: one launch of each

        def rank(item):
            group = item.get_closest_marker("xdist_group").args[0]
            kind = item.callspec.params.get("checkpoint", "") if hasattr(item, "callspec") else ""
            return FIRST.index(group) if group in FIRST else len(FIRST), kinds.setdefault(kind, len(kinds))

        items.sort(key=rank)  # stable: each group keeps its own order


def pytest_configure(config):
    config.pluginmanager.register(_Order(), "disagg-test-order")


def order_ends_deployment(items):
    """Tests marked `ends_deployment` stop or kill the deployment their module shares: each runs after the
    module's other tests (in their own order), wherever it is written."""
    last = [item for item in items if item.get_closest_marker("ends_deployment")]
    rest = [item for item in items if not item.get_closest_marker("ends_deployment")]
    order = []
    for item in rest:
        order.append(item)
        module = item.module
        later = [x for x in last if x.module is module]
        if later and item is [x for x in rest if x.module is module][-1]:
            order += later
    order += [x for x in last if x not in order]
    items[:] = order


def disagg(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """Run the disagg CLI as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "disagg", *args], capture_output=True, text=True, timeout=timeout, cwd=kw.pop("cwd", ROOT), **kw
    )


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def popen_cli(*args: str, **kw) -> subprocess.Popen:
    """`disagg ARGS` in the background, for a test that sends it Ctrl-C (SIGINT). Its SIGINT is at its default,
    as at a terminal, wherever the suite was started: a shell's background job (`nohup ... &`, CI) ignores
    SIGINT, and a child inherits that, so the test's Ctrl-C would be lost. Only then is the child's SIGINT
    reset (in the child, before exec: a preexec_fn, which the foreground case does without)."""
    reset = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    return subprocess.Popen([sys.executable, "-m", "disagg", *args], cwd=kw.pop("cwd", ROOT),
                            preexec_fn=_sigint_default if reset else None, **kw)


def tiny_unless_named(args: list[str]) -> list[str]:
    """Tests run the random-weight `tiny` model (parity with diffusers' pipeline, any size) unless they name a
    model or a config file; a user's `disagg launch` defaults to the trained `demo` one."""
    return args if "--model" in args or "--config" in args else [*args, "--model", "tiny"]


class Launched:
    """A `disagg launch` process running in the background."""

    def __init__(self, args: list[str], tmp: Path, port: int | None = None, log_name: str = "launch.log",
                 env: dict[str, str] | None = None):
        self.port = port or free_port_pair()
        if port is None and "--http-port" in args:  # the orchestrator's two ports must not be the HTTP one
            http = int(args[args.index("--http-port") + 1])
            while abs(self.port - http) <= 1:
                self.port = free_port_pair()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.run_dir = tmp / "run"
        self.log = open(tmp / log_name, "w")
        args = tiny_unless_named(args)
        if "--spares" not in args:  # a spare interpreter costs seconds of CPU: only where a test wants one
            args = [*args, "--spares", "0"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "disagg", "launch", "--port", str(self.port), "--run-dir", str(self.run_dir), *args],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True, env=env,
        )

    def wait_ready(self, n_instances: int, timeout: float = 240):
        from disagg.client import Client, Unreachable

        deadline = time.monotonic() + timeout
        with Client(self.endpoint) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise AssertionError(f"launch exited {self.proc.returncode}:\n{self.output()}")
                try:
                    report = client.status(timeout_s=2)
                    # and the launcher says so: until then a child that dies stops the launch (boot error)
                    # instead of being restarted
                    if sum(i.state == "ready" for i in report.instances) >= n_instances and " ready: " in self.output():
                        return report
                except Unreachable:
                    pass
                time.sleep(0.3)
        raise AssertionError(f"not ready in {timeout} s:\n{self.output()}")

    def status(self, timeout_s: float = 5):
        """The orchestrator's StatusReport."""
        from disagg.client import Client

        with Client(self.endpoint) as client:
            return client.status(timeout_s=timeout_s)

    def serve(self, n_instances: int):
        """For a module fixture (`yield from dep.serve(n)`): this deployment once n instances are ready,
        stopped afterwards."""
        try:
            self.wait_ready(n_instances)
            yield self
        finally:
            self.stop()

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def wait_until(pred, timeout=60, step=0.1, why=None):
    """pred() once it is true; else fail, saying why() (the state that kept it false) when given."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"condition not met in {timeout} s" + (f": {why()}" if why else ""))


def heard_from_all(endpoint: str) -> None:
    """Until every instance has sent the orchestrator a message since now: a role a second launch disturbed (its
    port or lane taken, its registration replaced) would be silent and, a heartbeat timeout later, dead."""
    from disagg.client import Client

    t0 = time.monotonic()

    def all_heard():
        t_query = time.monotonic()
        with Client(endpoint) as client:
            report = client.status()
        return all(i.state == "ready" and t_query - i.last_seen_s > t0 for i in report.instances)

    wait_until(all_heard, timeout=10, step=0.1)


def launch_with_http(args: list[str], tmp: Path) -> Launched:
    """`disagg launch ARGS --http-port P`; the result's `http` is the gateway's base URL."""
    port = free_port_pair()
    dep = Launched([*args, "--http-port", str(port)], tmp)
    dep.http = f"http://127.0.0.1:{port}"
    return dep


class Load:
    """Submits requests from a background thread (its own socket), collecting outcomes: `join` them."""

    def __init__(self, endpoint: str, params: list, concurrency: int = 50, timeout_s: float | None = None, curve=None):
        self.outcomes = None
        self.thread = threading.Thread(target=self._run, args=(endpoint, params, concurrency, timeout_s, curve),
                                       daemon=True)
        self.thread.start()

    def _run(self, endpoint, params, concurrency, timeout_s, curve):
        from disagg.client import Client

        with Client(endpoint, curve=curve) as client:
            self.outcomes = client.run_all(params, concurrency=concurrency, timeout_s=timeout_s)

    def join(self, timeout=240):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "requests still pending"
        return self.outcomes


@pytest.fixture(scope="session")
def checkpoint(request, tmp_path_factory):
    """A tiny checkpoint (tests/checkpoints.py; the parameter names its kind) served 1:1:1 with capacity 4,4,4
    behind a gateway that answers /health. Tests take it with
    `@pytest.mark.parametrize("checkpoint", [KIND, ...], indirect=True)`: pytest runs the tests of one kind
    together, across modules, so each kind is launched once and one at a time (the previous one stops)."""
    from tests.checkpoints import save_tiny

    kind = request.param
    tmp = tmp_path_factory.mktemp(f"ckpt-{kind}")
    folder = tmp / kind
    save_tiny(kind, folder)
    (tmp / "run").mkdir()
    for dep in launch_with_http(["--model", str(folder), "-e", "1", "-d", "1", "-k", "1", "--capacity", "4,4,4",
                                 "--no-dashboard"], tmp / "run").serve(3):
        wait_http(dep.http + "/health")
        dep.kind, dep.folder = kind, folder
        yield dep


@functools.lru_cache(maxsize=2)
def reference_pipeline(folder: Path, cls_name: str = "DiffusionPipeline"):
    """diffusers' own pipeline `cls_name` from a checkpoint folder, loaded once for the tests comparing with it
    (float32, no progress bars). Calls must pass their own generator."""
    import diffusers
    import torch

    pipe = getattr(diffusers, cls_name).from_pretrained(folder, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory, request):
    return tmp_path_factory.mktemp(request.module.__name__.split(".")[-1])


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread in this process for a module (`pytest.mark.usefixtures("one_thread")`): toy models run
    fastest so, do not crawl when other processes hold the CPUs, and sum in the order a role (one thread) does."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def wait_http(url: str, timeout: float = 30.0, expect: int = 200):
    """The response once `url` answers `expect`; fails after `timeout` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == expect:
                return r
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} did not answer {expect} in {timeout} s"
        time.sleep(0.2)


def deployment_id(run_dir: Path) -> str:
    """The deployment id of the launch whose run folder is `run_dir` (its orchestrator logs its settings)."""
    import re

    log = Path(run_dir) / "logs" / "orchestrator.log"
    found = re.search(r'"deployment_id":"([A-Za-z0-9_.-]+)"', log.read_text()) if log.exists() else None
    assert found, f"no deployment id in {log}"
    return found.group(1)


def segments_of(dep_id: str) -> list[str]:
    """The shared-memory segments of one deployment (its pools are named disagg-ID-INSTANCE-PID): tests look only
    at their own deployment's, since other tests' deployments may run beside them (pytest-xdist)."""
    from disagg.transport.data.shm import SHM_PREFIX, list_segments

    assert dep_id
    return list_segments(f"{SHM_PREFIX}{dep_id}-")
