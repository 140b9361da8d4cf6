"""One request's answer, after it is tokenized: submitted to the scheduler, then returned whole (unary) or
as server-sent events (stream). Both endings keep the engine's own finish: a stop sequence is a normal
finish (the engine ends the sequence at its next step and hands over its result, stats and all), and a
client that goes away cancels its request (its KV slot, or its place in the queue, is free at the
scheduler's next step)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from specrt.runtime.text import TextAssembler
from specrt.serving import guards
from specrt.serving.errors import ApiError
from specrt.serving.handle import Handle
from specrt.serving.responses import chat_logprobs, completion_logprobs, usage
from specrt.serving.state import ServerState

DISCONNECT_POLL_S = 0.2  # how often a unary request checks that its client is still there
ENGINE_FAILED = "the engine failed while generating this request; the server's log has the details"
log = logging.getLogger("specrt.serve")


async def serve(state: ServerState, request: Request, body, ids: list[int], chat: bool):
    """The response to a completion (`chat` False) or chat completion request of prompt tokens `ids`."""
    answer = Answer(state, body, state.submit(body, ids), len(ids), chat)
    if body.stream:
        return StreamingResponse(answer.events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await answer.whole(request)


class Answer:
    """The text, logprobs and ids of one submitted request as the OpenAI API shapes them."""

    def __init__(self, state: ServerState, body, handle: Handle, prompt_tokens: int, chat: bool):
        self.state, self.body, self.handle, self.prompt_tokens, self.chat = state, body, handle, prompt_tokens, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.text = TextAssembler(state.tokenizer.decode, body.stop)
        self.kind = "chat.completion" if chat else "text_completion"
        self.sent_logprobs = self.sent_chars = 0  # logprob entries and text characters already streamed

    def logprobs(self, entries, offset: int = 0) -> dict | None:
        if self.body.wanted_logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.state.tokenizer.decode)
        return completion_logprobs(entries, self.state.tokenizer.decode, offset)

    # ── unary ───────────────────────────────────────────────────────────────────────────────
    async def whole(self, request: Request) -> dict:
        handle, text = self.handle, self.text
        watcher = asyncio.create_task(watch(request, handle))
        try:
            async for tokens in handle:
                if handle.cancelled:  # stopped (or the client left): what the engine still sends is dropped
                    continue
                if text.feed(tokens) is None:  # a stop sequence: a normal finish, not a cancellation
                    handle.stop()
            text.flush()
        except Exception:
            log.exception("request %s failed in the engine", self.id)
            raise ApiError(500, ENGINE_FAILED, kind="server_error") from None
        finally:
            watcher.cancel()
        choice = {"index": 0, "finish_reason": text.finish_reason(handle.result),
                  "logprobs": self.logprobs(handle.logprobs[: text.tokens])}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text.text}
        else:
            choice["text"] = text.text
        out = {"id": self.id, "object": self.kind, "created": self.created, "model": self.state.model_name,
               "choices": [choice], "usage": usage(self.prompt_tokens, text.tokens, handle.cached_tokens)}
        if handle.result is not None:
            out["specrt"] = spec_stats(handle.result)
        return out

    # ── stream ──────────────────────────────────────────────────────────────────────────────
    def chunk(self, piece: str | None, finish: str | None, first: bool = False) -> str:
        """One SSE chunk: `piece` of text (chat's first chunk: the assistant's role) and the logprobs of
        the tokens it completes."""
        entries = self.handle.logprobs[self.sent_logprobs : self.text.tokens]
        logprobs = None if first else self.logprobs(entries, self.sent_chars)
        if not first:
            self.sent_logprobs += len(entries)
            self.sent_chars += len(piece or "")
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": piece} if piece else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": logprobs}
        return self.event({"choices": [choice]})

    def event(self, fields: dict) -> str:
        obj = {"id": self.id, "object": self.kind + ".chunk" if self.chat else self.kind, "created": self.created,
               "model": self.state.model_name, **fields}
        return sse(obj)

    async def events(self):
        handle, text = self.handle, self.text
        try:
            if self.chat:
                yield self.chunk(None, None, first=True)
            async for tokens in handle:
                piece = text.feed(tokens)
                if piece is None:  # a stop sequence
                    handle.stop()
                    if text.last_piece:
                        yield self.chunk(text.last_piece, None)
                    break
                if piece:
                    yield self.chunk(piece, None)
            tail = text.flush()
            if tail:
                yield self.chunk(tail, None)
            yield self.chunk(None, text.finish_reason(handle.result))
            if self.body.include_usage:
                yield self.event({"choices": [], "usage": usage(self.prompt_tokens, text.tokens, handle.cached_tokens)})
            yield "data: [DONE]\n\n"
        except Exception:
            log.exception("request %s failed in the engine", self.id)
            yield sse(guards.error_payload(ENGINE_FAILED, "server_error"))
        finally:  # also on client disconnect (the response task is cancelled)
            handle.cancel()


async def watch(request: Request, handle: Handle) -> None:
    """Cancel `handle` once its client has gone (a unary request learns it only by asking)."""
    while True:
        if await request.is_disconnected():
            handle.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


def sse(obj: dict) -> str:
    return "data: " + json.dumps(obj) + "\n\n"


def spec_stats(result) -> dict:
    """The `specrt` block of a unary response: what speculation did for this request."""
    s = result.stats
    return {"drafter_steps": s.steps, "drafted": s.drafted, "accepted": s.accepted,
            "mean_accepted_len": round(s.mean_accepted_len, 4), "acceptance_rate": round(s.acceptance_rate, 4),
            "tokens_per_s": round(s.tokens_per_s, 2)}
