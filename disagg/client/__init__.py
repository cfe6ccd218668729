"""Clients of a running orchestrator, shared by the CLI (launcher) and the HTTP gateway.

`client.sync.Client` is the blocking client (`disagg submit`, `status`, `stop`, `bench`);
`client.aio.AsyncClient` is the asyncio one the gateway multiplexes many requests over.
"""

from disagg.client.errors import BadRequest, GenerationFailed, RequestFailed, RetryLater  # noqa: F401
from disagg.client.sync import (  # noqa: F401 - the package's API
    DEFAULT_ENDPOINT,
    Client,
    Outcome,
    Unreachable,
    default_endpoint,
    new_request_id,
)
