"""`python -m disagg.roles --fork-server MODEL`: one process imports what a role of MODEL needs (torch, diffusers,
the model's adapter) once, then forks every CPU role of its launcher from that state, so a role's start
costs its model's load instead of ~5 s of imports (disagg/launcher/forks.py is the other end).

The protocol is JSON lines (no pickle): the launcher writes one order per line on our stdin,
    {"name": ..., "spec": SETTINGS_JSON, "env": {...}, "log": PATH}
and we answer on stdout `{"ready": true}` once imported, `{"name": ..., "pid": PID}` per fork, and
`{"exited": PID, "rc": CODE}` when a forked role ends (it is our child: we reap it and pass its status on).
EOF on stdin ends us at once (os._exit: no interpreter finalisation); the forked roles go on (each watches its
launcher itself, disagg/transport/parent.py).

The server stays single-threaded (a fork copies only the calling thread) and never initialises CUDA:
only roles without a GPU are forked."""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import traceback

from disagg.transport.environment import DISAGG_FORK_SERVER_PID, PYTORCH_NVML_BASED_CUDA_CHECK


def _say(obj: dict) -> None:
    os.write(1, (json.dumps(obj) + "\n").encode())


def _become(order: dict) -> int:
    """In the forked child: a role process of its own, as `python -m disagg.roles SPEC` would start it."""
    import setproctitle  # imported by serve() before anything touched the environment: it needs its memory

    # what ps (and psutil's cmdline) show: the command a fresh interpreter of this role would have
    setproctitle.setproctitle(f"{sys.executable} -m disagg.roles {order['spec']}")
    os.setsid()  # its own process group and session, like the launcher's start_new_session
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    fd = os.open(order["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()  # DISAGG_TITLE_ROOM too: it only kept room for the title
    os.environ.update(order["env"])
    os.environ[DISAGG_FORK_SERVER_PID] = str(os.getppid())  # our parent, the server, while the launcher lives
    sys.argv = [sys.argv[0], order["spec"]]
    from disagg.roles.__main__ import main

    return main([order["spec"]])


def _fork(order: dict) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    rc = 1
    try:
        rc = _become(order)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child must never return into the server's loop
        traceback.print_exc()
    finally:
        try:  # what an interpreter's exit does, then no return into the server's loop
            import atexit
            import logging

            logging.shutdown()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say({"exited": pid, "rc": os.waitstatus_to_exitcode(status)})


def serve(model: str) -> int:
    os.environ.setdefault(PYTORCH_NVML_BASED_CUDA_CHECK, "1")  # an is_available() must not initialise CUDA
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher ends us (EOF), not a terminal's Ctrl-C
    import setproctitle  # noqa: F401 - first: it takes over the memory of argv and the environment
    import torch  # noqa: F401 - the point: imported once, before any fork

    import disagg.roles.worker  # noqa: F401
    from disagg.roles.pipelines import preload

    preload(model)
    _say({"ready": True})
    buf = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.1)
        _reap()
        if not readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            # nothing of ours to clean up (the forked roles go on alone, their own sessions): skip the seconds an
            # interpreter that imported torch and diffusers takes to finalise them
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            order = {}
            try:
                order = json.loads(line)
                _say({"name": order["name"], "pid": _fork(order)})
            except Exception as exc:  # noqa: BLE001 - a bad order is answered, the server goes on
                _say({"name": order.get("name", "") if isinstance(order, dict) else "", "error": repr(exc)})
