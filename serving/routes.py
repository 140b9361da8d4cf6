"""The API's endpoints: module-level handlers over the app's `ServerState` (serving/state.py).

    GET  /health   /metrics (Prometheus)   /v1/models
    POST /v1/completions        raw prompt
    POST /v1/chat/completions   chat-templated messages

Text is bounded by characters before it is tokenized, and tokenized on a worker thread: the event loop
never does long work."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from specrt.errors import SpecrtError
from specrt.serving.completion import serve
from specrt.serving.errors import ApiError
from specrt.serving.protocol import ChatRequest, CompletionRequest
from specrt.serving.state import ServerState

router = APIRouter()
PATHS = {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"}  # metric labels


def server_state(request: Request) -> ServerState:
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]  # a handler's argument: its app's ServerState


@router.get("/health")
async def health(state: State) -> JSONResponse:
    """200 while the scheduler thread runs, else 503 (a load balancer takes the server out)."""
    scheduler = state.scheduler
    alive = scheduler.alive
    body = {"status": "ok" if alive else "scheduler stopped", "model": state.model_name, "slots": len(scheduler.slots),
            "running": scheduler.running, "waiting": len(scheduler.waiting), "drafter": scheduler.drafter_name}
    return JSONResponse(body, status_code=200 if alive else 503)


@router.get("/metrics")
async def metrics(state: State) -> Response:
    return Response(state.scheduler.metrics.render(), media_type=state.scheduler.metrics.CONTENT_TYPE)


@router.get("/v1/models")
async def models(state: State) -> dict:
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0, "owned_by": "specrt",
                                        "max_model_len": state.capacity, "specrt": state.exactness}]}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: State):
    state.check_model(body.model)
    state.check_length(len(body.prompt), "prompt")
    ids = await asyncio.to_thread(state.tokenizer.encode_prompt, body.prompt, True)
    return await serve(state, request, body, ids, chat=False)


@router.post("/v1/chat/completions")
async def chat(body: ChatRequest, request: Request, state: State):
    state.check_model(body.model)
    messages = [m.render() for m in body.messages]
    state.check_length(sum(len(m["content"]) for m in messages), "messages")
    try:
        ids = await asyncio.to_thread(state.tokenizer.encode_chat, messages)
    except SpecrtError as e:
        raise ApiError(400, str(e), "messages") from None
    return await serve(state, request, body, ids, chat=True)
