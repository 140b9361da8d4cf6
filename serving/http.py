"""The uvicorn server `specrt serve` runs, configured in one place (the loopback test and benchmark
servers use the same): h11 with a deadline for request heads, keep-alive and connection limits."""

from __future__ import annotations

from specrt.serving.api import Limits
from specrt.serving.guards import timed_h11

KEEP_ALIVE_S = 5.0
MAX_CONNECTIONS = 512  # beyond this uvicorn answers 503 (a client can hold many idle sockets)


def uvicorn_config(app, host: str, port: int, limits: Limits, log_level: str = "info",
                   max_connections: int = MAX_CONNECTIONS):
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          http=timed_h11(limits.read_timeout_s), timeout_keep_alive=KEEP_ALIVE_S,
                          limit_concurrency=max_connections)
