"""`python -m gateway`: the HTTP gateway process (`disagg launch --http-port` and `disagg serve-http` start it)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from transport.messages import BOOT_ERROR_EXIT


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gateway", description="disagg HTTP gateway (OpenAI-compatible)")
    ap.add_argument("--endpoint", required=True, help="the orchestrator's client endpoint, tcp://HOST:PORT")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--keys", default="", help="CurveZMQ keys directory of the deployment, when it uses them")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s [gateway] %(levelname)s %(message)s")
    import uvicorn

    from gateway.app import GatewaySettings, make_app

    # the key comes through the environment, not the command line (where `ps` would show it)
    settings = GatewaySettings(endpoint=args.endpoint, api_key=os.environ.get("DISAGG_API_KEY", ""), keys_dir=args.keys,
                               url=f"http://{args.host}:{args.port}")
    config = uvicorn.Config(make_app(settings), host=args.host, port=args.port, loop="uvloop", http="httptools",
                            log_level="warning", access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    try:
        server.run()
    except OSError as exc:  # the port is taken: a boot error, not a restart loop
        logging.getLogger("disagg.gateway").error("cannot serve on %s:%d: %s", args.host, args.port, exc)
        return BOOT_ERROR_EXIT
    if not server.started:  # uvicorn logs a bind failure and returns without raising
        return BOOT_ERROR_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
