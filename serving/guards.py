"""What stands between the network and the API: body size and read time, Host names, API keys, and
connections that never finish their headers.

    BodyGuard        ASGI middleware: a body over `max_bytes` is refused with 413 while it arrives
                     (Content-Length or chunked: at most `max_bytes` are ever held); a body that has not
                     arrived within `read_timeout_s` of its head gets 408.
    HostGuard        ASGI middleware: the Host header must be one of `allowed` (DNS-rebinding defence
                     of a server bound to loopback); 400 otherwise.
    ApiKeyGuard      ASGI middleware: /v1/* needs `Authorization: Bearer KEY` (401 otherwise);
                     /health and /metrics stay open, as vLLM's `--api-key` does.
    TimedH11         uvicorn's h11 protocol with a header deadline: a connection that has not sent a
                     complete request head within `header_timeout_s` of connecting (or of its last
                     response) is closed. uvicorn itself only times out idle keep-alive connections.

Each refusal is the API's OpenAI-style error body.
"""

from __future__ import annotations

import asyncio
import hmac
import json

from uvicorn.protocols.http.h11_impl import H11Protocol

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


def error_payload(message: str, kind: str = "invalid_request_error", param: str | None = None,
                  code: str | None = None) -> dict:
    """The OpenAI-style error object every refusal of the server carries."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def send_error(send, status: int, message: str, code: str | None = None, headers=(),
                     kind: str = "invalid_request_error") -> None:
    body = json.dumps(error_payload(message, kind, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})


class BodyGuard:
    def __init__(self, app, max_bytes: int, read_timeout_s: float):
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await send_error(send, 413, self._message(int(declared)), "request_too_large")
        # the whole body first (at most max_bytes are ever held), then the app reads it back
        chunks, size, more = [], 0, True
        deadline = asyncio.get_running_loop().time() + self.read_timeout_s
        while more:
            left = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.0))
            except asyncio.TimeoutError:
                return await send_error(send, 408, f"the request body did not arrive within {self.read_timeout_s:g} s "
                                        "(--timeout)", "request_timeout")
            if message["type"] != "http.request":  # the client went away
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await send_error(send, 413, self._message(size), "request_too_large")
            more = message.get("more_body", False)
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()

        return await self.app(scope, replayed, send)

    def _message(self, size: int) -> str:
        return (f"the request body has {size} bytes or more; this server accepts at most {self.max_bytes} "
                "(--max-body-bytes)")


class HostGuard:
    def __init__(self, app, allowed: list[str]):
        self.app = app
        self.allowed = {h.lower() for h in allowed}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and "*" not in self.allowed:
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1").lower()
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if host not in self.allowed and name not in self.allowed:
                return await send_error(send, 400, f"Host {host!r} is not served here (--allowed-hosts)",
                                        "invalid_host")
        return await self.app(scope, receive, send)


class ApiKeyGuard:
    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                return await send_error(send, 401, "a valid API key is needed: send 'Authorization: Bearer KEY'",
                                        "invalid_api_key", [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


def default_hosts(bind: str) -> list[str]:
    """Host names a server bound to `bind` answers by default: loopback names for a loopback bind (a web
    page's DNS-rebinding request carries its own name), any name otherwise."""
    return list(LOOPBACK_HOSTS) if bind in LOOPBACK_HOSTS else ["*"]


def timed_h11(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class, with a deadline for each request head."""

    class TimedH11(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm()

        def handle_events(self):
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a request head arrived: the body is BodyGuard's

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _arm(self):
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self):
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self):
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self.transport.close()

    return TimedH11
