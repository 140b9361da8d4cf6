"""The OpenAI-compatible HTTP API over the serving scheduler (FastAPI).

    POST /v1/completions        raw prompt               (stream: SSE chunks, then `data: [DONE]`)
    POST /v1/chat/completions   chat-templated messages  (stream: SSE deltas, then `data: [DONE]`)
    GET  /v1/models   /health   /metrics (Prometheus)

Every refusal is an OpenAI-style error body `{"error": {"message", "type", "param", "code"}}` with a
4xx status (503 when every slot and the queue are full); an error inside one request never stops the
server, answers 500 with a generic body (the details go to the server's log, never to the client) and
is counted in `specrt_requests_total` like every other status. A client that disconnects is cancelled:
its KV slot (or its place in the queue) is free at the scheduler's next step, and it counts as status
499 and in `specrt_cancelled_total`; a stop sequence ends a request normally (finish reason "stop").

The event loop never does long work: text is bounded by characters before it is tokenized (a text
longer than context × the longest token cannot fit) and tokenized on a worker thread; bodies, Host
names, API keys and slow clients are guarded before the API sees a request (serving/guards.py).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI

from specrt.serving import errors, guards
from specrt.serving.counted import Counted
from specrt.serving.errors import ApiError
from specrt.serving.routes import PATHS, router
from specrt.serving.scheduler import Scheduler
from specrt.serving.state import ServerState

__all__ = ["ApiError", "Limits", "create_app"]


@dataclass(frozen=True)
class Limits:
    """What the server accepts from the network (`specrt serve` options of the same names)."""

    max_body_bytes: int = 4 << 20
    read_timeout_s: float = 30.0  # a request's head, and its body, must arrive within this
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ("*",)


def create_app(scheduler: Scheduler, model_name: str, default_max_tokens: int = 256,
               limits: Limits | None = None) -> FastAPI:
    """The app over `scheduler`: its thread runs while the app does (the lifespan), every request passes
    the guards, then is counted, then reaches the handlers of serving/routes.py."""
    limits = limits or Limits()

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="specrt", lifespan=lifespan)
    app.state.server = ServerState(scheduler, model_name, default_max_tokens)
    # add_middleware: the last added runs first
    app.add_middleware(guards.BodyGuard, max_bytes=limits.max_body_bytes, read_timeout_s=limits.read_timeout_s)
    if limits.api_key:
        app.add_middleware(guards.ApiKeyGuard, key=limits.api_key)
    app.add_middleware(guards.HostGuard, allowed=list(limits.allowed_hosts))
    app.add_middleware(Counted, metrics=scheduler.metrics, known=PATHS)
    errors.install(app)
    app.include_router(router)
    return app
