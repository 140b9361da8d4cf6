"""A real uvicorn server on a loopback port, in a background thread, for the serving tests."""

from __future__ import annotations

import contextlib
import threading
import time

import uvicorn


@contextlib.contextmanager
def running(app, timeout: float = 60.0):
    """Serve `app` on 127.0.0.1 (a free port); yields the base URL; shuts down (lifespan included)."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
