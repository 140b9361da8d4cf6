"""The API's handlers called alone, without HTTP: each is a function over a `ServerState`."""

from __future__ import annotations

import asyncio

import pytest

from specrt.runtime.generate import Generator
from specrt.serving.completion import Answer, serve
from specrt.serving.errors import ApiError
from specrt.serving.protocol import ChatRequest, CompletionRequest
from specrt.serving.routes import health, models
from specrt.serving.scheduler import Scheduler
from specrt.serving.state import ServerState

PROMPT = "The capital of France is"


class _Connected:
    """A request whose client never leaves."""

    async def is_disconnected(self) -> bool:
        return False


@pytest.fixture(scope="module")
def gen(tiny_bundle):
    return Generator(tiny_bundle, drafter="ngram", max_seq_len=64, slots=2)


@pytest.fixture
def state(gen):
    """A state over a scheduler of its own (a stopped scheduler is not started again)."""
    return ServerState(Scheduler(gen), "tiny", 8)


def test_health_follows_the_scheduler_thread(state):
    assert asyncio.run(health(state)).status_code == 503  # not started: a load balancer takes it out
    state.scheduler.start()
    try:
        r = asyncio.run(health(state))
        assert r.status_code == 200 and b'"slots":2' in r.body and b'"drafter":"ngram"' in r.body
    finally:
        state.scheduler.stop()


def test_models_reports_the_context_and_exactness(state):
    (entry,) = asyncio.run(models(state))["data"]
    assert entry["id"] == "tiny" and entry["max_model_len"] == state.capacity == 64
    assert entry["specrt"]["slots"] == 2 and entry["specrt"]["lossless"] == state.gen.lossless


def test_checks_refuse_by_field(state):
    with pytest.raises(ApiError) as e:
        state.check_model("other")
    assert (e.value.status, e.value.param, e.value.code) == (404, "model", "model_not_found")
    with pytest.raises(ApiError) as e:
        state.check_length(state.max_chars + 1, "prompt")
    assert (e.value.status, e.value.code) == (400, "context_length_exceeded")
    state.check_length(state.max_chars, "prompt")  # at the bound: fits
    with pytest.raises(ApiError) as e:
        state.max_tokens(CompletionRequest(prompt="x", max_tokens=60), 10)  # 64 − 10 = 54 at most
    assert e.value.param == "max_tokens" and "54 at most" in e.value.message
    with pytest.raises(ApiError) as e:
        state.max_tokens(ChatRequest(messages=[{"role": "user", "content": "x"}], max_completion_tokens=60), 10)
    assert e.value.param == "max_completion_tokens"
    chat = ChatRequest(messages=[{"role": "user", "content": "x"}])  # names no limit (completions default to 16)
    assert state.max_tokens(chat, 10) == 8  # the server's default, within the room
    assert state.max_tokens(chat, 60) == 4  # … cut to the room left


def test_a_unary_answer_equals_single_request_decoding(state, tiny_reference):
    ids = state.tokenizer.encode_prompt(PROMPT, True)
    want = tiny_reference.generate_ids(ids, 6).token_ids
    state.scheduler.start()
    try:
        out = asyncio.run(serve(state, _Connected(), CompletionRequest(prompt=PROMPT, max_tokens=6, temperature=0),
                                ids, chat=False))
    finally:
        state.scheduler.stop()
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert out["choices"][0]["text"] == state.tokenizer.decode(want)
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 6, "total_tokens": len(ids) + 6}
    assert out["specrt"]["drafter_steps"] >= 1  # the engine's stats block


def test_stream_chunks_carry_the_chat_shape(state):
    class Held:  # a handle with nothing delivered yet
        logprobs: list = []

    answer = Answer(state, ChatRequest(messages=[{"role": "user", "content": "x"}], stream=True), Held(), 3, chat=True)
    first, piece = answer.chunk(None, None, first=True), answer.chunk("hi", None)
    assert '"object": "chat.completion.chunk"' in first and '"delta": {"role": "assistant", "content": ""}' in first
    assert '"delta": {"content": "hi"}' in piece and answer.sent_chars == 2
