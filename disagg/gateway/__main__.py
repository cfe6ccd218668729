"""`python -m disagg.gateway SETTINGS_JSON`: the HTTP gateway process (`disagg launch --http-port` and `disagg serve-http`
start it) with its settings.process.GatewaySettings. The API key comes in DISAGG_HTTP_API_KEY and the keys with a
priority in DISAGG_HTTP_API_KEYS, not on the command line (where `ps` would show them)."""

from __future__ import annotations

import logging
import os
import sys

import msgspec
import yaml

from disagg.transport.environment import DISAGG_HTTP_API_KEY, DISAGG_HTTP_API_KEYS, DISAGG_LOG_LEVEL
from disagg.transport.wire.messages import BOOT_ERROR_EXIT


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=os.environ.get(DISAGG_LOG_LEVEL, "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s [gateway] %(levelname)s %(message)s")
    log = logging.getLogger("disagg.gateway")
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        return BOOT_ERROR_EXIT
    from disagg.settings.process import GatewaySettings, decode, encode
    from disagg.settings.schema import HttpSettings

    try:
        settings = decode(argv[0], GatewaySettings)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        log.error("bad settings: %s", exc)
        return BOOT_ERROR_EXIT
    log.info("settings: %s", encode(settings))  # the API key is not in it: it comes from the environment
    settings.http.api_key = settings.http.api_key or os.environ.get(DISAGG_HTTP_API_KEY, "")
    try:  # the keys with a priority come the same way (JSON from the launcher; YAML or JSON by hand)
        keys = yaml.safe_load(os.environ.get(DISAGG_HTTP_API_KEYS) or "{}") or {}
        settings.http.api_keys = settings.http.api_keys or msgspec.convert({"api_keys": keys}, HttpSettings).api_keys
    except (yaml.YAMLError, msgspec.ValidationError) as exc:
        log.error("bad DISAGG_HTTP_API_KEYS (a mapping of API key -> priority or {priority, admin}): %s", exc)
        return BOOT_ERROR_EXIT
    import uvicorn

    from disagg.gateway.app import make_app
    from disagg.gateway.limits import slow_headers_protocol

    h = settings.http
    # httptools, with a timeout for the request headers (disagg/gateway/limits.py; the body's is in the app)
    config = uvicorn.Config(make_app(settings), host=h.host, port=h.port, loop="uvloop",
                            http=slow_headers_protocol(h.read_timeout), timeout_keep_alive=5,
                            log_level="warning", access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    try:
        server.run()
    except OSError as exc:  # the port is taken: a boot error, not a restart loop
        log.error("cannot serve on %s:%d: %s", h.host, h.port, exc)
        return BOOT_ERROR_EXIT
    if not server.started:  # uvicorn logs a bind failure and returns without raising
        return BOOT_ERROR_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
