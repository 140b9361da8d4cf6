"""/metrics tells what happened to each request: a stop sequence is a finish, not a cancellation; a
client that hangs up is 499 (not a server error, not the 200 it never read); a request dropped while
queued is cancelled like one dropped while generating."""

from __future__ import annotations

import json
import socket
from collections import Counter

import httpx
import pytest

from specrt.tools.loadgen import loopback_server as running
from tests.helpers import eventually
from tests.serving.conftest import Gate

PROMPT = "The list of colors: red, green, blue, red, green,"


class Arrivals:
    """ASGI wrapper around the app: counts, by path, the requests whose head has reached it (uvicorn calls
    the app once a request's head is in, before its body is read)."""

    def __init__(self, app):
        self.app, self.heads = app, Counter()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.heads[scope["path"]] += 1
        return await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def server(tiny_bundle):
    """(URL, scheduler, gate, arrivals): one slot, a queue of 4, its target passes behind a gate (open
    unless a test closes it), the requests whose head has arrived counted."""
    from specrt.runtime.generate import Generator
    from specrt.serving.api import create_app
    from specrt.serving.scheduler import Scheduler

    gen, gate = Generator(tiny_bundle, drafter="plain", max_seq_len=64, slots=1), Gate()
    scheduler = Scheduler(gen, max_waiting=4, runner=gate.runner(gen))
    arrivals = Arrivals(create_app(scheduler, "tiny"))
    with running(arrivals) as url:
        yield url, scheduler, gate, arrivals
        gate.reset()


@pytest.fixture()
def gate(server):
    """The server's gate, open again (and holding nothing) after the test, whatever happened in it."""
    yield server[2]
    server[2].reset()


def samples(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def metric(url: str, name: str) -> float:
    return samples(url).get(name, 0.0)


def wait_for(url: str, name: str, value: float) -> float:
    """`name`'s value once it reaches `value` (or the last seen, after `eventually`'s deadline). What is
    counted after the client has its answer (the scheduler's finish, the status once the response is
    sent) is counted a moment later: the test waits for it, then asserts the exact value."""
    seen = [0.0]

    def reached():
        seen[0] = metric(url, name)
        return seen[0] >= value

    eventually(reached)
    return seen[0]


CANCELLED, STOPPED = 'specrt_request_finish_total{reason="cancelled"}', 'specrt_request_finish_total{reason="stop"}'
CANCELLED_TOTAL = "specrt_cancelled_total"


def requests_total(status: int) -> str:
    return f'specrt_requests_total{{endpoint="/v1/completions",status="{status}"}}'


def stop_unseen(scheduler, stop: str):
    """A hold for the gate: the request in the only slot runs no further pass once its text holds `stop`
    until the server has stopped it, so the stop is seen while it still generates (a quick machine cannot
    run its 40 tokens out first). Evaluated at each pass, when every token so far has been delivered."""

    def unseen() -> bool:
        slot = scheduler.slots[0]
        handle, seq = slot.handle, slot.seq
        if handle is None or seq is None or handle.cancelled:
            return True
        return stop not in scheduler.gen.tokenizer.decode(seq.tokens[len(handle.prompt_ids):])

    return unseen


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_is_a_finish_not_a_cancellation(server, gate, stream):
    url, scheduler, _, _ = server
    ok = metric(url, requests_total(200))
    full = httpx.post(f"{url}/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0}).json()["choices"][0]["text"]
    stop = full[len(full) // 3 : len(full) // 3 + 3]
    assert len(stop) == 3, full
    assert wait_for(url, requests_total(200), ok + 1) == ok + 1  # counted before `before` is read
    gate.hold(stop_unseen(scheduler, stop))
    before = samples(url)
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stop": stop, "stream": stream}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        answer = r.read().decode()
    assert '"finish_reason": "stop"' in answer or '"finish_reason":"stop"' in answer, answer
    assert wait_for(url, STOPPED, before.get(STOPPED, 0) + 1) == before.get(STOPPED, 0) + 1
    assert wait_for(url, requests_total(200), before[requests_total(200)] + 1) == before[requests_total(200)] + 1
    after = samples(url)
    assert after.get(CANCELLED, 0) == before.get(CANCELLED, 0)
    assert after[CANCELLED_TOTAL] == before[CANCELLED_TOTAL]
    assert after[requests_total(200)] == before[requests_total(200)] + 1


def test_a_client_that_hangs_up_mid_body_is_499_not_500(server):
    url, _, _, arrivals = server
    before = samples(url)
    heads = arrivals.heads["/v1/completions"]
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\"")
        # the head is in: the server is reading the body when the client hangs up
        assert eventually(lambda: arrivals.heads["/v1/completions"] > heads)
    assert wait_for(url, requests_total(499), before.get(requests_total(499), 0) + 1) == \
        before.get(requests_total(499), 0) + 1
    assert metric(url, requests_total(500)) == before.get(requests_total(500), 0)


def test_requests_dropped_while_queued_are_cancelled(server, gate):
    url, scheduler, _, _ = server
    before = samples(url)
    queued_body = json.dumps({"prompt": PROMPT, "max_tokens": 4}).encode()
    queued = []

    def sent_then_queued():  # the body, then the client waits (before reading) until its request is queued
        yield queued_body
        queued.append(bool(eventually(lambda: len(scheduler.waiting) == 1)))

    gate.close()
    passes = gate.started
    gate.allow(1)  # the first request's prefill (its first token); its next pass waits at the gate
    with httpx.Client(base_url=url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 48, "temperature": 0,
                                                       "stream": True}) as s:
            lines = s.iter_lines()  # kept: a dropped iterator closes the response, and the client is gone
            next(lines)  # its first token came, its second pass waits: it holds the only slot
            # queued behind it, where nothing can serve it while the gate is closed; the client gives up
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/completions", content=sent_then_queued(), timeout=httpx.Timeout(60, read=0.5),
                           headers={"Content-Type": "application/json", "Content-Length": str(len(queued_body))})
            assert queued == [True]
            handle = scheduler.waiting[0]  # still queued: the scheduler is held at the first one's pass
            assert eventually(lambda: handle.cancelled)  # the server saw its client go
            gate.allow(1)  # one more pass of the first; the scheduler's next step drops the second from the queue
            # dropped from the queue while the first still generates (its third pass waits), and counted
            assert wait_for(url, CANCELLED_TOTAL, before[CANCELLED_TOTAL] + 1) == before[CANCELLED_TOTAL] + 1
            assert gate.wait_started(passes + 3)
            assert scheduler.running == 1 and not scheduler.waiting
        # the streaming client hung up too: cancelled while its pass is held (it cannot run its 48 tokens out)
        assert eventually(lambda: scheduler.slots[0].handle is not None and scheduler.slots[0].handle.cancelled)
        gate.open()
        assert wait_for(url, CANCELLED_TOTAL, before[CANCELLED_TOTAL] + 2) == before[CANCELLED_TOTAL] + 2
    assert wait_for(url, CANCELLED, before.get(CANCELLED, 0) + 2) == before.get(CANCELLED, 0) + 2
    assert wait_for(url, requests_total(499), before.get(requests_total(499), 0) + 2) == \
        before.get(requests_total(499), 0) + 2
    assert metric(url, requests_total(200)) == before.get(requests_total(200), 0)
    assert httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=60).status_code == 200
