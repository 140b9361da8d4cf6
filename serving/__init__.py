"""Serving: the continuous-batching scheduler, the OpenAI-compatible HTTP API and its metrics.

The HTTP stack is the `serve` extra (`pip install 'specrt[serve]'`), so the runtime and `specrt-run`
install without it; `require_http()` names what is missing instead of an ImportError deep inside."""

from __future__ import annotations

import importlib.util

from specrt.errors import SpecrtError

HTTP_MODULES = {"fastapi": "fastapi", "uvicorn": "uvicorn", "prometheus_client": "prometheus-client",
                "httpx": "httpx"}


def require_http(command: str) -> None:
    """Raise a one-line error naming the missing packages when the `serve` extra is not installed."""
    missing = [pkg for module, pkg in HTTP_MODULES.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise SpecrtError(f"{command} needs the HTTP server packages ({', '.join(missing)} missing): "
                          "pip install 'specrt[serve]'")
