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

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specrt.errors import SpecrtError
from specrt.runtime.logits import check_logit_bias
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.text import TextAssembler
from specrt.serving import guards
from specrt.serving.protocol import ChatRequest, CompletionRequest, describe_errors
from specrt.serving.responses import chat_logprobs, completion_logprobs, usage
from specrt.serving.scheduler import Handle, Scheduler, SchedulerFull

DISCONNECT_POLL_S = 0.2
ENGINE_FAILED = "the engine failed while generating this request; the server's log has the details"
log = logging.getLogger("specrt.serve")


@dataclass(frozen=True)
class Limits:
    """What the server accepts from the network (`specrt serve` options of the same names)."""

    max_body_bytes: int = 4 << 20
    read_timeout_s: float = 30.0  # a request's head, and its body, must arrive within this
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ("*",)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def _error(status: int, message: str, param=None, code=None, kind="invalid_request_error", headers=None):
    return JSONResponse(guards.error_payload(message, kind, param, code), status_code=status, headers=headers)


CLIENT_CLOSED = "499"  # nginx's status for a client that went away before its response was complete


class Counted:
    """Outermost ASGI middleware: counts every request by endpoint and status, and turns an exception
    no handler took into a generic 500 (logged with its traceback). A client that went away before its
    response was complete (mid-body, while generating, mid-stream) counts as 499, not as the status
    of a response it never read, nor as a server error."""

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


def create_app(scheduler: Scheduler, model_name: str, default_max_tokens: int = 256,
               limits: Limits | None = None) -> FastAPI:
    limits = limits or Limits()
    tokenizer, capacity = scheduler.gen.tokenizer, scheduler.gen.capacity
    metrics = scheduler.metrics
    gen = scheduler.gen
    vocab = gen.manifest.target.config.vocab_size
    max_chars = capacity * tokenizer.max_token_bytes
    exactness = {"lossless": gen.lossless, "exec_mode": gen.exactness.mode.name,
                 "batch_invariant": gen.exactness.lossless, "reason": gen.exactness.reason,
                 "drafter": scheduler.drafter_name, "requested_drafter": gen.requested_drafter, "slots": gen.slots,
                 # what greedy responses equal (sampled ones follow its distribution); null where not lossless
                 "exact_to": gen.reference.to_dict() if gen.lossless else None}

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="specrt", lifespan=lifespan)
    KNOWN = {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"}  # metric labels
    # add_middleware: the last added runs first
    app.add_middleware(guards.BodyGuard, max_bytes=limits.max_body_bytes, read_timeout_s=limits.read_timeout_s)
    if limits.api_key:
        app.add_middleware(guards.ApiKeyGuard, key=limits.api_key)
    app.add_middleware(guards.HostGuard, allowed=list(limits.allowed_hosts))
    app.add_middleware(Counted, metrics=metrics, known=KNOWN)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        message, param = describe_errors(exc.errors())
        return _error(400, message, param)

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return _error(exc.status, exc.message, exc.param, exc.code, exc.kind, headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)

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
        _check_length(len(body.prompt), "prompt")
        ids = await asyncio.to_thread(tokenizer.encode_prompt, body.prompt, True)
        return await _serve(request, body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        _check_model(body.model)
        messages = [m.render() for m in body.messages]
        _check_length(sum(len(m["content"]) for m in messages), "messages")
        try:
            ids = await asyncio.to_thread(tokenizer.encode_chat, messages)
        except SpecrtError as e:
            raise ApiError(400, str(e), "messages") from None
        return await _serve(request, body, ids, chat=True)

    # ── the request path ────────────────────────────────────────────────────────────────────
    def _check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(404, f"the model {name!r} does not exist: this server serves {model_name!r}",
                           "model", "model_not_found")

    def _check_length(chars: int, param: str) -> None:
        if chars > max_chars:
            raise ApiError(400, f"the {param} has {chars} characters: more than this server's context of {capacity} "
                           f"tokens can hold (at most {max_chars} characters): shorten it", param,
                           "context_length_exceeded")

    def _submit(body, ids: list[int]) -> Handle:
        if len(ids) >= capacity:
            raise ApiError(400, f"the prompt has {len(ids)} tokens but this server's context is {capacity} "
                           "tokens: shorten it", "prompt", "context_length_exceeded")
        room = capacity - len(ids)
        limit = body.completion_limit
        max_tokens = limit if limit is not None else min(default_max_tokens, room)
        if max_tokens > room:
            field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
            raise ApiError(400, f"{field} {max_tokens} does not fit: context {capacity} tokens − prompt "
                           f"{len(ids)} = {room} at most", field, "context_length_exceeded")
        try:
            check_logit_bias(body.logit_bias or {}, vocab)
        except ValueError as e:
            raise ApiError(400, f"logit_bias: {e}", "logit_bias") from None
        sampling = SamplingParams(body.temperature, body.top_k, body.top_p, body.seed)
        options = {"logit_bias": body.logit_bias, "logprobs": body.wanted_logprobs}
        try:
            return scheduler.submit(ids, max_tokens, sampling, asyncio.get_running_loop(), options)
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
            return StreamingResponse(_sse(handle, body, len(ids), text, rid, created, chat),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        watcher = asyncio.create_task(_watch(request, handle))
        try:
            async for tokens in handle:
                if handle.cancelled:  # stopped (or the client left): what the engine still sends is dropped
                    continue
                if text.feed(tokens) is None:  # a stop sequence: done (a normal finish, not a cancellation);
                    handle.stop()  # the engine ends it at its next step and hands over the result, stats and all
            text.flush()
        except Exception:
            log.exception("request %s failed in the engine", rid)
            raise ApiError(500, ENGINE_FAILED, kind="server_error") from None
        finally:
            watcher.cancel()
        finish = text.finish_reason(handle.result)
        choice = {"index": 0, "finish_reason": finish, "logprobs": _logprobs(body, handle.logprobs[: text.tokens], chat)}
        if chat:
            choice["message"] = {"role": "assistant", "content": text.text}
        else:
            choice["text"] = text.text
        out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
               "model": model_name, "choices": [choice], "usage": usage(len(ids), text.tokens)}
        if handle.result is not None:
            out["specrt"] = _spec_stats(handle.result)
        return out

    def _logprobs(body, entries, chat: bool, offset: int = 0) -> dict | None:
        if body.wanted_logprobs is None:
            return None
        if chat:
            return chat_logprobs(entries, tokenizer.decode)
        return completion_logprobs(entries, tokenizer.decode, offset)

    async def _sse(handle: Handle, body, prompt_tokens: int, text: TextAssembler, rid: str, created: int, chat: bool):
        kind = "chat.completion.chunk" if chat else "text_completion"
        sent = {"logprobs": 0, "chars": 0}  # logprob entries and text characters already streamed

        def chunk(piece: str | None, finish: str | None, first: bool = False) -> str:
            entries = handle.logprobs[sent["logprobs"] : text.tokens]
            logprobs = None if first else _logprobs(body, entries, chat, sent["chars"])
            if not first:
                sent["logprobs"] += len(entries)
                sent["chars"] += len(piece or "")
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": piece} if piece else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            else:
                choice = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": logprobs}
            return _event({"id": rid, "object": kind, "created": created, "model": model_name, "choices": [choice]})

        try:
            if chat:
                yield chunk(None, None, first=True)
            async for tokens in handle:
                piece = text.feed(tokens)
                if piece is None:  # a stop sequence
                    handle.stop()
                    if text.last_piece:
                        yield chunk(text.last_piece, None)
                    break
                if piece:
                    yield chunk(piece, None)
            tail = text.flush()
            if tail:
                yield chunk(tail, None)
            yield chunk(None, text.finish_reason(handle.result))
            if body.include_usage:
                yield _event({"id": rid, "object": kind, "created": created, "model": model_name, "choices": [],
                              "usage": usage(prompt_tokens, text.tokens)})
            yield "data: [DONE]\n\n"
        except Exception:
            log.exception("request %s failed in the engine", rid)
            yield _event(guards.error_payload(ENGINE_FAILED, "server_error"))
        finally:  # also on client disconnect (the response task is cancelled)
            handle.cancel()

    async def _watch(request: Request, handle: Handle) -> None:
        while True:
            if await request.is_disconnected():
                handle.cancel()
                return
            await asyncio.sleep(DISCONNECT_POLL_S)

    return app


def _event(obj: dict) -> str:
    return "data: " + json.dumps(obj) + "\n\n"


def _spec_stats(result) -> dict:
    s = result.stats
    return {"drafter_steps": s.steps, "drafted": s.drafted, "accepted": s.accepted,
            "mean_accepted_len": round(s.mean_accepted_len, 4), "acceptance_rate": round(s.acceptance_rate, 4),
            "tokens_per_s": round(s.tokens_per_s, 2)}
