"""Review M7: a transfer engine that applies to a role's pool but cannot start there (a GPU pool Mooncake cannot
register without GPUDirect RDMA) is shown loudly, not only in the role's log: its Register says so, and status,
the live table and /metrics show it while the instance lives. Its hand-offs across hosts go inline meanwhile."""

from __future__ import annotations

import io
import sys
import types

from prometheus_client import CollectorRegistry, generate_latest
from rich.console import Console

from disagg.gateway.metrics import StatusCollector
from disagg.launcher.cli.dashboard import status_view
from disagg.orchestrator.router import Router, RouterConfig
from disagg.transport.data import mooncake_engine
from disagg.transport.data.engines import make_engines
from disagg.transport.data.pool import ShmPool
from disagg.transport.wire.messages import PoolInfo, Register
from tests.test_gpu_paths import HostCudaPool


def fake_mooncake(monkeypatch, register_rc: int) -> None:
    """The CUDA build of Mooncake, whose register_memory of our pool returns `register_rc`."""

    class Engine:
        def initialize(self, *args):
            return 0

        def get_rpc_port(self):
            return 15000

        def register_memory(self, addr, nbytes):
            return register_rc

    module = types.ModuleType("mooncake.engine")
    module.TransferEngine = Engine
    monkeypatch.setitem(sys.modules, "mooncake", types.ModuleType("mooncake"))
    monkeypatch.setitem(sys.modules, "mooncake.engine", module)
    monkeypatch.setattr(mooncake_engine, "cuda_build_installed", lambda: True)


def test_an_engine_that_applies_but_cannot_start_is_a_problem_one_that_does_not_apply_is_not(monkeypatch):
    fake_mooncake(monkeypatch, register_rc=-1)
    problems: dict[str, str] = {}
    engines = make_engines(HostCudaPool(ipc=None, ipc_error="RuntimeError: no IPC here"), "auto", problems=problems)
    assert list(engines) == ["inline"]
    assert problems == {"cuda-ipc": "torch cannot share the pool over CUDA IPC: RuntimeError: no IPC here",
                        "mooncake": "Mooncake register_memory of the 1048576-byte pool returned -1"}
    pool = ShmPool(f"disagg-test-problems-{id(problems)}", 1 << 20)
    try:  # a host pool: cuda-ipc does not apply, shm and mooncake start
        fake_mooncake(monkeypatch, register_rc=0)
        problems = {}
        assert list(make_engines(pool, "auto", problems=problems)) == ["shm", "mooncake", "inline"]
        assert problems == {}
    finally:
        pool.close()


def test_status_the_live_table_and_metrics_show_it_while_the_instance_lives():
    router = Router(RouterConfig(), now=100.0)
    reason = "Mooncake register_memory of the 1073741824-byte pool returned -1"
    pool = PoolInfo(host_id="h2", engines=["cuda-ipc", "inline"], pool_name="p-d0", pool_bytes=1 << 30,
                    device="cuda:0")
    register = Register(role="denoiser", instance_id="denoiser-0@h2", pid=7, host_id="h2", device="cuda:0",
                        capacity=1, pool=pool, ready=True, unavailable_engines={"mooncake": reason})
    router.handle_instance("denoiser-0@h2", register, [], 100.0)
    router.handle_instance("denoiser-0@h2", register, [], 101.0)  # registered again: warned about once
    report = router.snapshot(101.0)
    [inst] = report.instances
    assert inst.unavailable_engines == {"mooncake": reason}
    [warning] = [w for w in report.warnings if "mooncake unavailable" in w]
    assert "denoiser-0@h2" in warning and reason in warning and "inline through the orchestrator" in warning

    console = Console(record=True, file=io.StringIO(), width=300)
    console.print(status_view(report, width=300))
    assert f"denoiser-0@h2: mooncake unavailable ({reason})" in console.export_text()

    collector = StatusCollector()
    collector.report = report
    registry = CollectorRegistry()
    registry.register(collector)
    metrics = generate_latest(registry).decode()
    assert ('disagg_transfer_engine_unavailable{engine="mooncake",instance="denoiser-0@h2",role="denoiser"} 1.0'
            in metrics)


def test_under_a_forced_engine_the_others_are_no_problem(monkeypatch):
    fake_mooncake(monkeypatch, register_rc=-1)
    pool = ShmPool(f"disagg-test-forced-{id(monkeypatch)}", 1 << 20)
    try:
        problems: dict[str, str] = {}
        assert list(make_engines(pool, "shm", problems=problems)) == ["shm", "inline"]
        assert problems == {}
    finally:
        pool.close()
