"""The OpenAI-compatible HTTP API over the serving scheduler (FastAPI).

    POST /v1/completions        raw prompt               (stream: SSE chunks, then `data: [DONE]`)
    POST /v1/chat/completions   chat-templated messages  (stream: SSE deltas, then `data: [DONE]`)
    GET  /v1/models   /health   /metrics (Prometheus)

Every refusal is an OpenAI-style error body `{"error": {"message", "type", "param", "code"}}` with a
4xx status (503 when every slot and the queue are full); an error inside one request never stops the
server. A client that disconnects is cancelled: its KV slot is free at the scheduler's next step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specrt.errors import SpecrtError
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.serving.protocol import ChatRequest, CompletionRequest
from specrt.runtime.serving.scheduler import Handle, Scheduler, SchedulerFull
from specrt.runtime.text import TextAssembler

DISCONNECT_POLL_S = 0.2


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def _error(status: int, message: str, param=None, code=None, kind="invalid_request_error", headers=None):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def _describe(errors) -> tuple[str, str | None]:
    """One readable line from pydantic's errors, and the first offending field."""
    parts, seen = [], {}
    for e in errors:
        if e.get("type") == "json_invalid":
            return f"the request body is not valid JSON ({e.get('ctx', {}).get('error', 'parse error')})", None
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        field = loc[0] if loc else "body"  # one message per field (a union reports each alternative)
        if field not in seen and len(seen) < 5:
            seen[field] = True
            parts.append(f"{field}: {e.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request body", next(iter(seen), None)


def create_app(scheduler: Scheduler, model_name: str, default_max_tokens: int = 256) -> FastAPI:
    tokenizer, capacity = scheduler.gen.tokenizer, scheduler.gen.capacity
    metrics = scheduler.metrics
    gen = scheduler.gen
    exactness = {"lossless": gen.lossless, "exec_mode": gen.exactness.mode.name,
                 "batch_invariant": gen.exactness.lossless, "reason": gen.exactness.reason,
                 "drafter": scheduler.drafter_name, "requested_drafter": gen.requested_drafter, "slots": gen.slots}

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="specrt", lifespan=lifespan)
    KNOWN = {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"}  # metric labels

    @app.middleware("http")
    async def count(request: Request, call_next):
        response = await call_next(request)
        metrics.requests.labels(request.url.path if request.url.path in KNOWN else "other",
                                str(response.status_code)).inc()
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        message, param = _describe(exc.errors())
        return _error(400, message, param)

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return _error(exc.status, exc.message, exc.param, exc.code, exc.kind, headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)

    @app.exception_handler(Exception)
    async def internal(request, exc: Exception):
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")

    # ── endpoints ───────────────────────────────────────────────────────────────────────────
    @app.get("/health")
    async def health():
        alive = scheduler.alive
        body = {"status": "ok" if alive else "scheduler stopped", "model": model_name, "slots": len(scheduler.slots),
                "running": scheduler.running, "waiting": len(scheduler.waiting), "drafter": scheduler.drafter_name}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "specrt",
                                            "max_model_len": capacity, "specrt": exactness}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model)
        return await _serve(request, body, tokenizer.encode_prompt(body.prompt, raw=True), chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        _check_model(body.model)
        try:
            ids = tokenizer.encode_chat([m.model_dump() for m in body.messages])
        except SpecrtError as e:
            raise ApiError(400, str(e), "messages") from None
        return await _serve(request, body, ids, chat=True)

    # ── the request path ────────────────────────────────────────────────────────────────────
    def _check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(404, f"the model {name!r} does not exist: this server serves {model_name!r}",
                           "model", "model_not_found")

    def _submit(body, ids: list[int]) -> Handle:
        if len(ids) >= capacity:
            raise ApiError(400, f"the prompt has {len(ids)} tokens but this server's context is {capacity} "
                           "tokens: shorten it", "prompt", "context_length_exceeded")
        room = capacity - len(ids)
        max_tokens = body.max_tokens if body.max_tokens is not None else min(default_max_tokens, room)
        if max_tokens > room:
            raise ApiError(400, f"max_tokens {max_tokens} does not fit: context {capacity} tokens − prompt "
                           f"{len(ids)} = {room} at most", "max_tokens", "context_length_exceeded")
        sampling = SamplingParams(body.temperature, body.top_k, body.top_p, body.seed)
        try:
            return scheduler.submit(ids, max_tokens, sampling, asyncio.get_running_loop())
        except SchedulerFull as e:
            raise ApiError(503, str(e), code="server_busy", kind="server_error") from None
        except SpecrtError as e:
            raise ApiError(400, str(e)) from None

    async def _serve(request: Request, body, ids: list[int], chat: bool):
        handle = _submit(body, ids)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        text = TextAssembler(tokenizer.decode, body.stop)
        if body.stream:
            return StreamingResponse(_sse(handle, text, rid, created, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        watcher = asyncio.create_task(_watch(request, handle))
        try:
            async for tokens in handle:
                if text.feed(tokens) is None:  # a stop sequence: done
                    handle.cancel()
                    break
            text.flush()
        except SpecrtError as e:
            raise ApiError(500, str(e), kind="server_error") from None
        finally:
            watcher.cancel()
        finish = text.finish_reason(handle.result)
        usage = {"prompt_tokens": len(ids), "completion_tokens": text.tokens,
                 "total_tokens": len(ids) + text.tokens}
        choice = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text.text}
        else:
            choice["text"] = text.text
        out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
               "model": model_name, "choices": [choice], "usage": usage}
        if handle.result is not None:
            out["specrt"] = _spec_stats(handle.result)
        return out

    async def _sse(handle: Handle, text: TextAssembler, rid: str, created: int, chat: bool):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": piece} if piece else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": None}
            return "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": model_name,
                                          "choices": [choice]}) + "\n\n"

        try:
            if chat:
                yield chunk(None, None, first=True)
            async for tokens in handle:
                piece = text.feed(tokens)
                if piece is None:  # a stop sequence
                    handle.cancel()
                    if text.last_piece:
                        yield chunk(text.last_piece, None)
                    break
                if piece:
                    yield chunk(piece, None)
            tail = text.flush()
            if tail:
                yield chunk(tail, None)
            yield chunk(None, text.finish_reason(handle.result))
            yield "data: [DONE]\n\n"
        except SpecrtError as e:
            err = {"error": {"message": str(e), "type": "server_error", "param": None, "code": None}}
            yield "data: " + json.dumps(err) + "\n\n"
        finally:  # also on client disconnect (the response task is cancelled)
            handle.cancel()

    async def _watch(request: Request, handle: Handle) -> None:
        while True:
            if await request.is_disconnected():
                handle.cancel()
                return
            await asyncio.sleep(DISCONNECT_POLL_S)

    return app


def _spec_stats(result) -> dict:
    s = result.stats
    return {"drafter_steps": s.steps, "drafted": s.drafted, "accepted": s.accepted,
            "mean_accepted_len": round(s.mean_accepted_len, 4), "acceptance_rate": round(s.acceptance_rate, 4),
            "tokens_per_s": round(s.tokens_per_s, 2)}
