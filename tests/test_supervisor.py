"""The launcher's Supervisor on real processes: the ranks of one parallel instance restart together, once; a fork
server that fails."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import pytest

from disagg.launcher.supervisor import RestartPolicy, Supervisor
from tests.conftest import wait_until

#: a rank that runs until it is killed, or exits 1 a moment after SIGTERM as a torch.distributed rank does
#: when its peer is gone (gloo raises, the role exits 1)
RANK = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(1))\ntime.sleep(600)\n"


def test_one_rank_killed_restarts_the_group_once_and_the_new_ranks_are_left_alone(tmp_path):
    # ranks that ran long enough to count as healthy restart at once (as after a long run under load)
    sup = Supervisor(tmp_path, RestartPolicy(initial_delay_s=0.05, healthy_s=0.0))
    ranks = [sup.spawn(name, [sys.executable, "-c", RANK], group="denoiser-0")
             for name in ("denoiser-0", "denoiser-0.r1")]
    sup.spawn("other", [sys.executable, "-c", RANK])
    try:
        first = {c.name: c.pid for c in ranks}
        os.kill(first["denoiser-0.r1"], signal.SIGKILL)
        # turns until both ranks run again as new processes, then more turns: nothing more may happen
        wait_until(lambda: sup.supervise() or all(c.pid != first[c.name] and c.proc.poll() is None for c in ranks),
                   timeout=30, step=0.02, why=lambda: [(c.name, c.pid, c.returncode) for c in ranks])
        second = {c.name: c.pid for c in ranks}
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            sup.supervise()
            time.sleep(0.02)
        events = []
        while not sup.events.empty():
            events.append(sup.events.get())
        # the rank stopped with the group is restarted with it, not taken for a new failure of the group
        # (which stopped the freshly restarted rank, and so on until the group was given up)
        assert {c.name: c.pid for c in ranks} == second, events
        assert all(c.proc.poll() is None and c.restarts == 1 and not c.gave_up for c in ranks), events
        assert sum("stops with" in e for e in events) == 1, events
        assert sup.children["other"].restarts == 0
        # the group's two ranks meet at the same new rendezvous
        assert ranks[0].env["DISAGG_DIST_INIT"] == ranks[1].env["DISAGG_DIST_INIT"], events
    finally:
        sup.stop_all(grace_s=1)


def test_a_retired_child_is_never_restarted_whether_its_exit_was_seen_before_or_after(tmp_path):
    """A rebalance order taken for an instance that crashed on its way out (disagg/launcher/deployment.py:
    take_orders): its device serves the new instance, so the restart its crash scheduled must not happen."""
    sup = Supervisor(tmp_path, RestartPolicy(initial_delay_s=0.2, healthy_s=1e9))  # a restart 0.2 s after the exit
    seen = sup.spawn("decoder-1", [sys.executable, "-c", RANK])
    unseen = sup.spawn("decoder-2", [sys.executable, "-c", RANK])
    control = sup.spawn("decoder-3", [sys.executable, "-c", RANK])
    try:
        os.kill(unseen.pid, signal.SIGKILL)
        unseen.proc.wait()
        with sup.lock:  # retired before the supervisor saw it exit
            sup.retire(unseen)
        for child in (seen, control):
            os.kill(child.pid, signal.SIGKILL)
            child.proc.wait()
        sup.supervise()  # decoder-1's exit and decoder-3's are seen: restarts scheduled
        assert seen.restart_at is not None and control.restart_at is not None
        with sup.lock:
            sup.retire(seen)
        wait_until(lambda: sup.supervise() or control.restarts == 1, timeout=30, step=0.02)
        sup.supervise()
        assert (seen.restarts, unseen.restarts) == (0, 0) and seen.restart_at is None and unseen.restart_at is None
        assert seen.proc.poll() is not None and unseen.proc.poll() is not None
    finally:
        sup.stop_all(grace_s=1)


@pytest.mark.parametrize("ending", [
    "sys.exit(3)",  # at once
    "os.close(1); time.sleep(0.5); sys.exit(3)",  # its output ends first: a fork asked meanwhile gets no answer
])
def test_a_fork_server_that_fails_its_imports_says_so_once_and_roles_start_fresh(tmp_path, caplog, ending):
    """A fork server that exits before it is ready (status 3) forks nothing: each role starts a fresh interpreter
    instead, and the launcher tells why once, naming the server's log."""
    from disagg.launcher.forks import ForkServer

    log = tmp_path / "fork-server.log"
    server = ForkServer([sys.executable, "-c", f"import os, sys, time; sys.stderr.write('no torch here'); {ending}"],
                        {}, log)
    with caplog.at_level(logging.WARNING, logger="disagg.launcher"):
        assert server.fork("encoder-0", "{}", {}, tmp_path / "e.log") is None
        assert server.fork("denoiser-0", "{}", {}, tmp_path / "d.log") is None
    told = [r.getMessage() for r in caplog.records if "fork server" in r.getMessage()]
    assert len(told) == 1 and "status 3" in told[0] and str(log) in told[0], told
    assert "no torch here" in log.read_text()
    server.close()
