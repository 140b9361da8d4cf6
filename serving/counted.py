"""The outermost ASGI middleware: every request counted by endpoint and status."""

from __future__ import annotations

import logging

from specrt.serving import guards

CLIENT_CLOSED = "499"  # nginx's status for a client that went away before its response was complete
log = logging.getLogger("specrt.serve")


class Counted:
    """Counts every request by endpoint and status, and turns an exception no handler took into a generic
    500 (logged with its traceback). A client that went away before its response was complete (mid-body,
    while generating, mid-stream) counts as 499, not as the status of a response it never read, nor as a
    server error. Paths outside `known` share the label "other" (the label set stays bounded)."""

    def __init__(self, app, metrics, known: set[str]):
        self.app, self.metrics, self.known = app, metrics, known

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status, complete, gone = None, False, False

        async def watched(message):
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        async def listened():
            nonlocal gone
            message = await receive()
            if message["type"] == "http.disconnect" and not complete:
                gone = True
            return message

        try:
            await self.app(scope, listened, watched)
        except Exception:
            log.exception("internal error on %s %s", scope.get("method"), scope["path"])
            if status is None:
                status = 500
                await guards.send_error(send, 500, "internal server error", kind="server_error")
        finally:
            path = scope["path"] if scope["path"] in self.known else "other"
            self.metrics.requests.labels(path, CLIENT_CLOSED if gone else str(status or 500)).inc()
