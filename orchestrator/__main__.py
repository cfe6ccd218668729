"""`python -m orchestrator`: the orchestrator process (the launcher starts it)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import msgspec

from orchestrator.requests import ROLES
from orchestrator.router import Router, RouterConfig
from orchestrator.server import OrchestratorServer
from transport.messages import BOOT_ERROR_EXIT, ModelIdentity
from transport.shm import SHM_PREFIX


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator", description="disagg orchestrator")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=5555)
    ap.add_argument("--heartbeat-timeout", type=float, default=3.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--stall-timeout", type=float, default=120.0)
    ap.add_argument("--max-retries", type=int, default=2)
    ap.add_argument("--max-queue", type=int, default=4096)
    ap.add_argument("--colocated", action="store_true", help="route requests to monolithic instances")
    ap.add_argument("--dispatch", default="max-free-slots")
    ap.add_argument("--transfer", default="auto")
    ap.add_argument("--deployment-id", default="",
                    help="refuse role instances of any other deployment (empty: take any)")
    ap.add_argument("--standby", default="", metavar="ROLE=N,...",
                    help="warm standbys to keep per role, e.g. denoiser=1 (they get work once an instance dies)")
    ap.add_argument("--host-blind", action="store_true",
                    help="dispatch ignores which host holds a request's input (to compare with host-aware dispatch)")
    ap.add_argument("--keys", default="", help="CurveZMQ keys directory; empty = no authentication")
    ap.add_argument("--no-lane", action="store_true",
                    help="no same-host fast lane: every control message takes ZeroMQ (transport/lane.py)")
    ap.add_argument("--join-wait", type=float, default=30.0,
                    help="seconds a role may have no instance before Submits are refused as not ready")
    ap.add_argument("--model-identity", default="",
                    help="JSON ModelIdentity of the deployment's model; instances serving another are refused "
                         "(empty: the first instance's)")
    ap.add_argument("--host-id", default="", help="the host this runs on, as launchers name hosts")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s [orchestrator] %(levelname)s %(message)s"
    )
    config = RouterConfig(
        heartbeat_timeout_s=args.heartbeat_timeout,
        request_timeout_s=args.request_timeout,
        dispatch=args.dispatch,
        transfer=args.transfer,
        stall_timeout_s=args.stall_timeout,
        max_retries=args.max_retries,
        max_queue={role: args.max_queue for role in ROLES},
        colocated=args.colocated,
        deployment_id=args.deployment_id,
        host_aware=not args.host_blind,
        standby={role: int(n) for role, _, n in (kv.partition("=") for kv in args.standby.split(",") if kv)},
        join_wait_s=args.join_wait,
        model=msgspec.json.decode(args.model_identity, type=ModelIdentity) if args.model_identity else None,
        host_id=args.host_id,
    )
    try:
        router = Router(config, now=time.monotonic())
        # a restart: clients resubmit and roles re-register; it resumes their requests (orchestrator/recovery.py)
        router.restarted(int(os.environ.get("DISAGG_RESTARTS", "0")), time.monotonic())
        server = OrchestratorServer(router, args.host, args.port, args.keys, lane=not args.no_lane)
    except Exception as exc:  # bad address, port taken: a boot error, not a crash loop
        logging.getLogger("disagg.orchestrator").error("cannot start: %s", exc)
        return BOOT_ERROR_EXIT
    server.run()
    run_id = os.environ.get("DISAGG_RUN_ID")
    if server.orphaned and run_id:  # the launcher was killed: nobody else removes what killed roles left
        from transport.shm import remove_segments

        remove_segments(f"{SHM_PREFIX}{run_id}-", only_dead=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
