"""/metrics tells what happened to each request: a stop sequence is a finish, not a cancellation; a
client that hangs up is 499 (not a server error, not the 200 it never read); a request dropped while
queued is cancelled like one dropped while generating."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from specrt.tools.loadgen import loopback_server as running
from tests.serving.conftest import slow_model

PROMPT = "The list of colors: red, green, blue, red, green,"
PASS_S = 0.05  # every target pass: a request of n tokens runs about n × PASS_S


@pytest.fixture(scope="module")
def server(tiny_bundle):
    """(URL, scheduler): one slot, a queue of 4, slow target passes."""
    from specrt.runtime.generate import Generator
    from specrt.serving.api import create_app
    from specrt.serving.scheduler import Scheduler

    scheduler = Scheduler(Generator(tiny_bundle, drafter="plain", max_seq_len=64, slots=1), max_waiting=4)
    slow_model(scheduler, PASS_S)
    with running(create_app(scheduler, "tiny")) as url:
        yield url, scheduler


def samples(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def metric(url: str, name: str) -> float:
    return samples(url).get(name, 0.0)


def wait_for(url: str, name: str, value: float, seconds: float = 5.0) -> float:
    """`name`'s value once it reaches `value` (or the last seen, after `seconds`)."""
    deadline = time.monotonic() + seconds
    while (seen := metric(url, name)) < value and time.monotonic() < deadline:
        time.sleep(0.05)
    return seen


CANCELLED, STOPPED = 'specrt_request_finish_total{reason="cancelled"}', 'specrt_request_finish_total{reason="stop"}'
CANCELLED_TOTAL = "specrt_cancelled_total"


def requests_total(status: int) -> str:
    return f'specrt_requests_total{{endpoint="/v1/completions",status="{status}"}}'


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_is_a_finish_not_a_cancellation(server, stream):
    url, scheduler = server
    full = httpx.post(f"{url}/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0}).json()["choices"][0]["text"]
    stop = full[len(full) // 3 : len(full) // 3 + 3]
    assert len(stop) == 3, full
    before = samples(url)
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stop": stop, "stream": stream}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        answer = r.read().decode()
    assert '"finish_reason": "stop"' in answer or '"finish_reason":"stop"' in answer, answer
    assert wait_for(url, STOPPED, before.get(STOPPED, 0) + 1) == before.get(STOPPED, 0) + 1
    after = samples(url)
    assert after.get(CANCELLED, 0) == before.get(CANCELLED, 0)
    assert after[CANCELLED_TOTAL] == before[CANCELLED_TOTAL]
    assert after[requests_total(200)] == before[requests_total(200)] + 1


def test_a_client_that_hangs_up_mid_body_is_499_not_500(server):
    url, _ = server
    before = samples(url)
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\"")
        time.sleep(0.2)  # the head is in: the server is reading the body
    assert wait_for(url, requests_total(499), before.get(requests_total(499), 0) + 1) == \
        before.get(requests_total(499), 0) + 1
    assert metric(url, requests_total(500)) == before.get(requests_total(500), 0)


def test_requests_dropped_while_queued_are_cancelled(server):
    url, scheduler = server
    before = samples(url)
    with httpx.Client(base_url=url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 48, "temperature": 0,
                                                       "stream": True}) as s:
            lines = s.iter_lines()  # kept: a dropped iterator closes the response, and the client is gone
            next(lines)  # the request holds the only slot for about 48 × PASS_S
            with pytest.raises(httpx.ReadTimeout):  # queued behind it; the client gives up
                httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=0.5)
            # dropped from the queue while the first still generates, and counted
            assert wait_for(url, CANCELLED_TOTAL, before[CANCELLED_TOTAL] + 1, seconds=1.5) == \
                before[CANCELLED_TOTAL] + 1
            assert scheduler.running == 1 and not scheduler.waiting
        # the streaming client hung up too
        assert wait_for(url, CANCELLED_TOTAL, before[CANCELLED_TOTAL] + 2) == before[CANCELLED_TOTAL] + 2
    assert wait_for(url, CANCELLED, before.get(CANCELLED, 0) + 2) == before.get(CANCELLED, 0) + 2
    assert wait_for(url, requests_total(499), before.get(requests_total(499), 0) + 2) == \
        before.get(requests_total(499), 0) + 2
    assert metric(url, requests_total(200)) == before.get(requests_total(200), 0)
    assert httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=60).status_code == 200
