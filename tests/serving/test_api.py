"""The OpenAI-compatible API on a real loopback server: outputs, streaming, stop, errors, metrics."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from specrt.tools.loadgen import loopback_server as running
from tests.helpers import eventually
from tests.serving.conftest import Gate

PROMPT = "The list of colors: red, green, blue, red, green,"


def _reference(ref, ids, n):
    out = ref.generate_ids(ids, n).token_ids
    return out, ref.tokenizer.decode(out)


def _sse(response) -> list[dict | str]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_completion_greedy_equals_plain_generation(served, tiny_reference):
    url, _ = served
    ids = tiny_reference.tokenizer.encode_prompt(PROMPT, raw=True)
    want_ids, want = _reference(tiny_reference, ids, 20)
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 20,
                                                 "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["choices"][0]["text"] == want
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(want_ids),
                             "total_tokens": len(ids) + len(want_ids)}
    assert body["choices"][0]["finish_reason"] == ("stop" if want_ids[-1] in tiny_reference.eos else "length")
    assert body["specrt"]["drafted"] >= body["specrt"]["accepted"] >= 0


def test_chat_stream_equals_chat_non_stream(served, tiny_reference):
    url, _ = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name two colors."}]
    ids = tiny_reference.tokenizer.encode_chat(messages)
    _, want = _reference(tiny_reference, ids, 24)
    req = {"messages": messages, "max_tokens": 24, "temperature": 0}
    plain = httpx.post(f"{url}/v1/chat/completions", json=req, timeout=60).json()
    assert plain["object"] == "chat.completion"
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": want}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**req, "stream": True}, timeout=60) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = _sse(s)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_stop_sequences_cut_the_text(served, tiny_reference):
    url, _ = served
    ids = tiny_reference.tokenizer.encode_prompt(PROMPT, raw=True)
    _, full = _reference(tiny_reference, ids, 24)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3
    want = full[: full.index(stop)]
    req = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stop": [stop, "\x00never"]}
    body = httpx.post(f"{url}/v1/completions", json=req, timeout=60).json()
    assert body["choices"][0] == {"index": 0, "text": want, "finish_reason": "stop", "logprobs": None}
    # the speculation stats every other unary response carries (they were missing on a stop)
    assert set(body["specrt"]) >= {"drafter_steps", "drafted", "accepted", "tokens_per_s"}, body
    with httpx.stream("POST", f"{url}/v1/completions", json={**req, "stream": True}, timeout=60) as s:
        events = _sse(s)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_seeded_sampling_is_reproducible(served):
    url, _ = served
    req = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.8, "top_p": 0.9}
    a = [httpx.post(f"{url}/v1/completions", json={**req, "seed": s}, timeout=60).json()["choices"][0]["text"]
         for s in (1, 2, 1)]
    assert a[0] == a[2] and a[0] != a[1]


BAD = [
    ({"prompt": 3}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "one prompt"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": "x", "temperature": 5}, 400, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**12}, 400, "does not fit"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "x", "n": 3}, 400, "n"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": "x", "seed": -1}, 400, "seed"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "does not exist"),
    ({"prompt": "word " * 200}, 400, "context is 64"),
    ({}, 400, "prompt"),
]


@pytest.mark.parametrize("body,status,reason", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_completion_requests_get_a_reason(served, body, status, reason):
    url, _ = served
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert reason in err["message"] or reason == err["param"], err
    assert err["type"] == "invalid_request_error"


def test_malformed_bodies_and_fuzz_never_crash_the_server(served):
    url, _ = served
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        for body in ([], "x", None, {"messages": []}, {"messages": [{"role": "wizard", "content": "hi"}]},
                     {"messages": [{"role": "user"}]}, {"messages": "hello"}):
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["message"]
        rng = np.random.default_rng(0)
        values = [None, True, -1, 0, 1, 2.5, 1e308, "", "x", "🙂" * 3, [], [1, "a"], {"a": {}}, 10**30]
        fields = ["prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "n", "model"]
        for _ in range(60):
            body = {f: values[rng.integers(len(values))] for f in rng.choice(fields, rng.integers(1, 5), replace=False)}
            body.setdefault("max_tokens", 2)
            r = c.post("/v1/completions", json=body)
            assert r.status_code in (200, 400, 404), (body, r.status_code, r.text)
            if r.status_code != 200:
                assert r.json()["error"]["message"]
        ok = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200 and c.get("/health").json()["status"] == "ok"


def test_health_models_and_metrics(served):
    url, _ = served
    httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0}, timeout=60)
    ok = 'specrt_requests_total{endpoint="/v1/completions",status="200"}'
    # counted once its response has gone out (after the client may have read it)
    assert eventually(lambda: ok in httpx.get(f"{url}/metrics").text)
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["slots"] == 4 and health["drafter"] == "ngram"
    models = httpx.get(f"{url}/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 64
    text = httpx.get(f"{url}/metrics").text
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert samples[ok] >= 1
    assert samples["specrt_generation_tokens_total"] >= 8
    assert samples["specrt_spec_decode_num_draft_tokens_total"] >= samples["specrt_spec_decode_num_accepted_tokens_total"]
    per_pos = sum(v for k, v in samples.items() if k.startswith("specrt_spec_decode_num_accepted_tokens_per_pos_total"))
    assert per_pos == samples["specrt_spec_decode_num_accepted_tokens_total"]
    assert samples["specrt_e2e_request_latency_seconds_count"] >= 1
    assert samples["specrt_time_to_first_token_seconds_count"] >= 1
    assert samples["specrt_verify_pass_seconds_count"] >= 1
    assert 'specrt_batch_size_bucket{le="1.0"}' in samples


def test_health_is_503_once_the_scheduler_stopped(tiny_bundle):
    from specrt.runtime.generate import Generator
    from specrt.serving.api import create_app
    from specrt.serving.scheduler import Scheduler

    scheduler = Scheduler(Generator(tiny_bundle, drafter="plain", max_seq_len=64, slots=1))
    with running(create_app(scheduler, "tiny")) as url:
        up = httpx.get(f"{url}/health")
        scheduler.stop()  # the server still answers; its scheduler does not
        down = httpx.get(f"{url}/health")
    assert up.status_code == 200 and up.json()["status"] == "ok"
    assert down.status_code == 503 and down.json()["status"] == "scheduler stopped"
    assert set(up.json()) == set(down.json()) == {"status", "model", "slots", "running", "waiting", "drafter"}


@pytest.fixture()
def gated_server(tiny_bundle):
    """(URL, scheduler, gate): one slot, no queue, every target pass held at a closed gate until the test
    lets it run."""
    from specrt.runtime.generate import Generator
    from specrt.serving.api import create_app
    from specrt.serving.scheduler import Scheduler

    gen, gate = Generator(tiny_bundle, drafter="plain", max_seq_len=64, slots=1), Gate(closed=True)
    scheduler = Scheduler(gen, max_waiting=0, runner=gate.runner(gen))
    with running(create_app(scheduler, "tiny")) as url:
        yield url, scheduler, gate
        gate.reset()  # whatever the test left held runs, so the server shuts down


def test_full_server_answers_503_and_disconnect_frees_the_slot(gated_server):
    url, scheduler, gate = gated_server
    req = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True}
    with httpx.Client(base_url=url, timeout=60) as c:
        gate.allow(1)  # its prefill (the first token); its next pass waits at the gate
        with c.stream("POST", "/v1/completions", json=req) as s:
            lines = s.iter_lines()  # kept: a dropped iterator closes the response, and the client is gone
            next(lines)  # the first token came ...
            assert gate.wait_started(2) and scheduler.running == 1  # ... and its second pass waits: it holds the slot
            busy = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
            assert "retry later" in busy.json()["error"]["message"]
        # the client hung up mid-stream: the server cancels the request while its pass is still held (so it
        # cannot finish its 40 tokens first), then the slot is free within a step
        assert eventually(lambda: scheduler.slots[0].handle is not None and scheduler.slots[0].handle.cancelled)
        gate.open()
        assert eventually(lambda: scheduler.running == 0)
        text = c.get("/metrics").text
        assert "specrt_cancelled_total 1.0" in text
        assert c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200
