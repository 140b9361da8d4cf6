"""The server under a hostile but fair client: oversized and slow bodies, slow heads, foreign Host names,
missing API keys, invalid text, OpenAI fields it must honour or refuse, and errors that must stay
generic and counted."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from specrt.serving.api import Limits
from specrt.serving.guards import LOOPBACK_HOSTS
from specrt.tools.loadgen import loopback_server as running
from tests.helpers import eventually

KEY = "sk-test-5f2b"
# a request's head and body get 30 s here (no ordinary request of these tests meets the deadline, however
# loaded the machine); the `impatient` server's TIMEOUT_S is the one its slow-client test waits out
LIMITS = Limits(max_body_bytes=64 << 10, read_timeout_s=30.0, api_key=KEY, allowed_hosts=LOOPBACK_HOSTS)
TIMEOUT_S = 0.5
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The list of colors: red, green, blue, red, green,"


class Breakable:
    """A scheduler's runner: its generator's passes, or an engine error while `broken`."""

    def __init__(self, gen):
        self.gen, self.broken = gen, False

    def __call__(self, bp):
        if self.broken:
            raise RuntimeError("secret /internal/path detail")
        return self.gen.model.run_batch(bp.windows, bp.start)


@pytest.fixture(scope="module")
def guarded(tiny_bundle):
    from specrt.runtime.generate import Generator
    from specrt.serving.api import create_app
    from specrt.serving.scheduler import Scheduler

    gen = Generator(tiny_bundle, drafter="ngram", max_seq_len=64, slots=2)
    scheduler = Scheduler(gen, max_waiting=8, runner=Breakable(gen))
    with running(create_app(scheduler, "tiny", default_max_tokens=8, limits=LIMITS), limits=LIMITS) as url:
        yield url, scheduler


@pytest.fixture()
def impatient(tiny_bundle):
    """The URL of a server guarded like `guarded` whose request heads and bodies must arrive within
    TIMEOUT_S."""
    from specrt.runtime.generate import Generator
    from specrt.serving.api import create_app
    from specrt.serving.scheduler import Scheduler

    limits = dataclasses.replace(LIMITS, read_timeout_s=TIMEOUT_S)
    scheduler = Scheduler(Generator(tiny_bundle, drafter="ngram", max_seq_len=64, slots=2), max_waiting=8)
    with running(create_app(scheduler, "tiny", default_max_tokens=8, limits=limits), limits=limits) as url:
        yield url


def _post(url, path, body, **kw):
    return httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=60, **kw)


def _metric(url, endpoint, status) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f'specrt_requests_total{{endpoint="{endpoint}",status="{status}"}}'):
            return float(line.split()[-1])
    return 0.0


# ── the network boundary ────────────────────────────────────────────────────────────────────
def test_api_key_is_required_on_v1_only(guarded):
    url, _ = guarded
    body = {"prompt": PROMPT, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert _post(url, "/v1/completions", body).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200


def test_foreign_host_names_are_refused(guarded):
    url, _ = guarded
    r = httpx.get(f"{url}/health", headers={"Host": "attacker.example:8000"})
    assert r.status_code == 400 and "attacker.example" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/health", headers={"Host": "localhost:1234"}).status_code == 200


def test_oversized_bodies_are_refused_as_they_arrive(guarded):
    url, _ = guarded
    big = {"prompt": PROMPT, "max_tokens": 2, "ignored": "x" * (LIMITS.max_body_bytes + 1)}
    r = _post(url, "/v1/completions", big)
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: counted as it streams in
        yield b'{"prompt": "hi", "pad": "'
        for _ in range(LIMITS.max_body_bytes // 4096 + 2):
            yield b"y" * 4096
        yield b'"}'

    r = httpx.post(f"{url}/v1/completions", content=chunked(), headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413
    # each counted once its refusal has gone out (after the client may have read it)
    assert eventually(lambda: _metric(url, "/v1/completions", 413) >= 2)


def _raw(url) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)  # far beyond what the server takes


def test_slow_heads_are_closed_and_slow_bodies_get_408(impatient):
    url = impatient
    t0 = time.monotonic()  # before connecting: the server's deadline starts later, when it accepts
    s = _raw(url)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")  # never finishes its head
    assert s.recv(1024) == b""  # closed by the server
    # at its deadline, not at once: the server starts the clock when it accepts, after t0, so the lower
    # bound holds on any machine; the upper one leaves 10× the deadline (nothing else of the server's
    # closes a connection before its first head, so without the deadline recv would wait out its 30 s)
    assert 0.8 * TIMEOUT_S < time.monotonic() - t0 < 10 * TIMEOUT_S
    s.close()

    s = _raw(url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " + KEY.encode()
              + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    reply = b""
    while chunk := s.recv(4096):  # until the server closes the connection
        reply += chunk
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
    s.close()
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def test_tokenizing_never_blocks_the_event_loop(guarded, monkeypatch):
    url, scheduler = guarded
    tok = scheduler.gen.tokenizer
    encode = tok.encode_prompt
    tokenizing, answered, released = threading.Event(), threading.Event(), []

    def slow_encode(*args, **kwargs):  # tokenizing goes on until /health has answered
        tokenizing.set()
        released.append(answered.wait(60))
        return encode(*args, **kwargs)

    monkeypatch.setattr(tok, "encode_prompt", slow_encode)
    result = {}
    t = threading.Thread(target=lambda: result.update(r=_post(url, "/v1/completions", {"prompt": PROMPT,
                                                                                       "max_tokens": 2})))
    t.start()
    try:
        assert tokenizing.wait(30)  # the other request is being tokenized ...
        # ... and is until /health has answered: the answer came while it was (a tokenizer on the event
        # loop would keep /health from answering at all, and this get would time out)
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    finally:
        answered.set()
    t.join(60)
    assert released == [True]  # the tokenizer was let go by the answer, not by its own timeout
    assert result["r"].status_code == 200


def test_text_longer_than_the_context_can_hold_is_refused_before_tokenizing(guarded, monkeypatch):
    url, scheduler = guarded
    calls = []
    tok = scheduler.gen.tokenizer
    monkeypatch.setattr(tok, "encode_chat", lambda *a, **k: calls.append(1) or [])
    huge = "a" * 60_000  # within the body limit, beyond 64 tokens × the longest token
    r = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "messages" and calls == []


# ── fields: honoured or refused ─────────────────────────────────────────────────────────────
@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "required"),
    ("response_format", {"type": "json_object"}),
    ("presence_penalty", 0.5),
    ("repetition_penalty", 1.2),
    ("ignore_eos", True),
    ("audio", {"voice": "alloy"}),
])
def test_unimplemented_fields_are_refused_naming_them(guarded, field, value):
    url, _ = guarded
    r = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_neutral_values_and_content_parts_are_accepted(guarded):
    url, _ = guarded
    body = {"messages": [{"role": "developer", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "presence_penalty": 0,
            "user": "u-1", "metadata": {"a": "b"}, "max_completion_tokens": 3}
    r = _post(url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3


def test_max_completion_tokens_is_honoured(guarded):
    url, _ = guarded
    body = {"messages": [{"role": "user", "content": "Count to ten."}], "max_completion_tokens": 3,
            "temperature": 0}
    r = _post(url, "/v1/chat/completions", body).json()
    assert r["usage"]["completion_tokens"] == 3 and r["choices"][0]["finish_reason"] == "length"
    bad = _post(url, "/v1/chat/completions", {**body, "max_tokens": 5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_completion_tokens"


def test_invalid_text_is_400_not_500(guarded):
    url, _ = guarded
    raw = b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}'
    r = httpx.post(f"{url}/v1/chat/completions", content=raw, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
    raw = b'{"prompt": "x\\udfff", "max_tokens": 2}'
    r = httpx.post(f"{url}/v1/completions", content=raw, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_logit_bias_is_honoured_and_checked(guarded):
    url, scheduler = guarded
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    plain = _post(url, "/v1/completions", {**body, "logprobs": 0}).json()["choices"][0]["logprobs"]["tokens"]
    forced = scheduler.gen.tokenizer.encode_prompt(" blue", raw=True)[-1]
    r = _post(url, "/v1/completions", {**body, "logit_bias": {str(forced): 100}, "logprobs": 0}).json()
    piece = scheduler.gen.tokenizer.decode([forced])
    assert r["choices"][0]["logprobs"]["tokens"] == [piece] * 6 != plain
    for bad, word in ((f"{scheduler.gen.manifest.target.config.vocab_size}", "vocabulary"), ("5", "outside")):
        value = 500 if word == "outside" else 1
        e = _post(url, "/v1/completions", {**body, "logit_bias": {bad: value}})
        assert e.status_code == 400 and e.json()["error"]["param"] == "logit_bias" and word in e.text


def _plain_rows(gen, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Plain decoding of n tokens one pass at a time, and the logits row that chose each token."""
    rows = []

    def run(p):
        outs = gen.run_pass(p)
        rows.append(outs["logits"][0, -1].astype(np.float64))
        return outs

    seq = gen.sequence(ids, n)
    out = seq.prefill(run)
    while (new := seq.step(run)) is not None:
        out += new
    return out, np.stack(rows[: len(out)])


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_logprobs_come_from_the_target_distribution(guarded, tiny_reference):
    url, _ = guarded
    ids = tiny_reference.tokenizer.encode_prompt(PROMPT, raw=True)
    out, rows = _plain_rows(tiny_reference, ids, 6)
    want = _log_softmax(rows)
    choice = _post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                            "logprobs": 3}).json()["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"] and len(lp["token_logprobs"]) == len(out) == 6
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(6)]
    for i, tok in enumerate(out):
        assert lp["token_logprobs"][i] == pytest.approx(float(want[i, tok]), abs=1e-4)
        best = np.argsort(-want[i])[:3]
        assert list(lp["top_logprobs"][i].values()) == pytest.approx([float(want[i, t]) for t in best], abs=1e-4)


def test_chat_logprobs_streamed_equal_whole(guarded):
    url, _ = guarded
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    whole = _post(url, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"]["content"]
    assert len(whole) == 4 and all(len(e["top_logprobs"]) == 2 for e in whole)
    assert all(e["top_logprobs"][0]["logprob"] == e["logprob"] <= 0 for e in whole)  # greedy: the best
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, timeout=60,
                      json={**chat, "stream": True, "stream_options": {"include_usage": True}}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = [x for c in chunks for ch in c["choices"] if ch.get("logprobs") for x in ch["logprobs"]["content"]]
    assert streamed == whole
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


# ── errors: generic, counted ────────────────────────────────────────────────────────────────
def test_engine_errors_are_generic_and_counted(guarded, monkeypatch):
    url, scheduler = guarded
    before = _metric(url, "/v1/completions", 500)
    scheduler.runner.broken = True
    try:
        r = _post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    finally:
        scheduler.runner.broken = False
    assert r.status_code == 500 and "secret" not in r.text and r.json()["error"]["type"] == "server_error"

    def crash(*args, **kwargs):
        raise KeyError("secret-key")

    monkeypatch.setattr(scheduler.gen.tokenizer, "encode_prompt", crash)
    r = _post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    assert r.status_code == 500 and "secret" not in r.text and r.json()["error"]["type"] == "server_error"
    # each counted once its response has gone out (after the client may have read it)
    assert eventually(lambda: _metric(url, "/v1/completions", 500) >= before + 2)
    assert _metric(url, "/v1/completions", 500) == before + 2
    monkeypatch.undo()
    assert _post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200


# ── values of the wrong JSON type: refused, never converted ─────────────────────────────────
LAX = [  # (field, value, the type the message names): each was silently converted before
    ("max_tokens", True, "integer"), ("max_tokens", "4", "integer"), ("max_tokens", 4.0, "integer"),
    ("stream", "yes", "boolean"), ("stream", 1, "boolean"), ("temperature", "0.5", "number"),
    ("temperature", True, "number"), ("top_p", "0.9", "number"), ("top_k", "3", "integer"),
    ("top_k", 3.0, "integer"), ("seed", True, "integer"), ("seed", "7", "integer"), ("n", True, "integer"),
    ("n", 1.0, "integer"), ("echo", 0, "boolean"), ("logprobs", True, "integer"), ("best_of", True, "integer"),
    ("stop", ["a", 3], "string"), ("presence_penalty", False, "number"), ("min_tokens", False, "integer"),
    ("logit_bias", {"5": "1"}, "number"), ("logit_bias", {"5": True}, "number"),
    ("logit_bias", {"five": 1}, "token id"), ("stream_options", {"include_usage": "yes"}, "boolean"),
]


@pytest.mark.parametrize("field, value, kind", LAX, ids=[f"{f}={v!r}" for f, v, _ in LAX])
def test_values_of_the_wrong_type_are_refused(guarded, field, value, kind):
    url, _ = guarded
    body = {"prompt": PROMPT, "max_tokens": 2, **({"stream": True} if field == "stream_options" else {}),
            field: value}
    r = _post(url, "/v1/completions", body)
    assert r.status_code == 400, (field, value, r.text)
    error = r.json()["error"]
    assert error["param"] == field and kind in error["message"] and "\n" not in error["message"], error
    assert error["message"].startswith(f"{field}: "), error


@pytest.mark.parametrize("field, value, kind", [("logprobs", 1, "boolean"), ("max_completion_tokens", "3", "integer"),
                                                ("top_logprobs", True, "integer")])
def test_chat_values_of_the_wrong_type_are_refused(guarded, field, value, kind):
    url, _ = guarded
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, field: value}
    r = _post(url, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field and kind in r.text, r.text


def test_the_message_says_what_was_sent(guarded):
    url, _ = guarded
    r = _post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": "4"})
    assert r.json()["error"]["message"] == 'max_tokens: Input should be a valid integer, not a string ("4")'
    r = _post(url, "/v1/completions", {"prompt": PROMPT, "stop": 5})
    assert r.json()["error"]["message"] == "stop: Input should be a valid string or a valid list, not an integer (5)"


def test_json_numbers_and_token_id_keys_still_pass(guarded):
    """What strictness must not refuse: an integer where a number is wanted, decimal token-id keys."""
    url, _ = guarded
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 1, "top_p": 1, "seed": 4, "logit_bias": {"17": 1},
            "n": 1, "presence_penalty": 0, "stream": False}
    assert _post(url, "/v1/completions", body).status_code == 200


# ── temperatures too small for float32 ──────────────────────────────────────────────────────
@pytest.mark.parametrize("temperature", [1e-300, 1e-38, 1e-42])
def test_tiny_temperatures_sample_the_argmax_not_token_0(guarded, temperature):
    """T = 1e-300 passed validation, then logits / float32(T) was nan: token 0 every step (1e-38 too
    once a logit passes 3.4; the tiny model's stay below, 1e-42 overflows them). The limit of sampling
    as T -> 0 is the argmax, so the answer is greedy's."""
    url, _ = guarded
    body = {"prompt": PROMPT, "max_tokens": 8, "logprobs": 0, "seed": 5}
    greedy = _post(url, "/v1/completions", {**body, "temperature": 0}).json()["choices"][0]
    tiny = _post(url, "/v1/completions", {**body, "temperature": temperature})
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy["text"]
    assert tiny.json()["choices"][0]["logprobs"]["tokens"] == greedy["logprobs"]["tokens"]
    assert len(set(greedy["logprobs"]["tokens"])) > 1
