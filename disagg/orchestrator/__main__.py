"""`python -m disagg.orchestrator`: the orchestrator process (the launcher starts it)."""

from __future__ import annotations

import gc
import logging
import os
import sys
import time

import msgspec

from disagg.orchestrator.router import Router, RouterConfig
from disagg.orchestrator.server import OrchestratorServer
from disagg.settings.process import decode, encode
from disagg.transport.data.shm import SHM_PREFIX
from disagg.transport.environment import DISAGG_LOG_LEVEL, DISAGG_RESTARTS, DISAGG_RUN_ID
from disagg.transport.wire.messages import BOOT_ERROR_EXIT

#: allocations between two collections of the youngest generation (Python's default: 700)
GC_GEN0 = 20_000


def main(argv: list[str] | None = None) -> int:
    """`python -m disagg.orchestrator SETTINGS_JSON` (settings.process.OrchestratorSettings, encoded by the launcher)."""
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=os.environ.get(DISAGG_LOG_LEVEL, "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s [orchestrator] %(levelname)s %(message)s")
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\nusage: python -m disagg.orchestrator SETTINGS_JSON", file=sys.stderr)
        return BOOT_ERROR_EXIT
    try:
        config = decode(argv[0], RouterConfig)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        logging.getLogger("disagg.orchestrator").error("bad settings: %s", exc)
        return BOOT_ERROR_EXIT
    logging.getLogger("disagg.orchestrator").info("settings: %s", encode(config))
    try:
        router = Router(config, now=time.monotonic())
        # a restart: clients resubmit and roles re-register; it resumes their requests (disagg/orchestrator/parts/recovery.py)
        router.restarted(int(os.environ.get(DISAGG_RESTARTS, "0")), time.monotonic())
        server = OrchestratorServer(router, config.host, config.port, config.keys, lane=config.lane)
    except Exception as exc:  # bad address, port taken: a boot error, not a crash loop
        logging.getLogger("disagg.orchestrator").error("cannot start: %s", exc)
        return BOOT_ERROR_EXIT
    # what booted lives as long as the process: the cyclic collector need not scan it again and again, and a turn's
    # short-lived objects (messages, Outs) are freed by reference counts, so a collection every GC_GEN0 allocations
    # suffices (BENCHMARKS.md, control plane)
    gc.freeze()
    gc.set_threshold(GC_GEN0, *gc.get_threshold()[1:])
    server.run()
    run_id = os.environ.get(DISAGG_RUN_ID)
    if run_id:  # what killed roles of this run left: the launcher removes it too, unless it is killed meanwhile
        from disagg.transport.data.shm import remove_segments

        remove_segments(f"{SHM_PREFIX}{run_id}-", only_dead=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
