"""Load: 500 requests at concurrency 8 with mixed parameters on a loopback server — no errors, every
greedy response equal to single-request plain generation, memory flat after warm-up."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import numpy as np

from specrt.runtime.generate import Generator
from specrt.runtime.serving.api import create_app
from specrt.runtime.serving.loadgen import loopback_server as running
from specrt.runtime.serving.scheduler import Scheduler

PROMPTS = ["The list of colors: red, green, blue, red, green,", "Once upon a time", "1 2 3 4 5 6 7 8",
           "Hello! How are you today?", "def add(a, b):\n    return", "Paris is the capital of"]
REQUESTS, CONCURRENCY, WARMUP = 500, 8, 100


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _requests(rng: np.random.Generator) -> list[dict]:
    out = []
    for i in range(REQUESTS):
        chat = bool(rng.integers(2))
        prompt = PROMPTS[int(rng.integers(len(PROMPTS)))]
        body = {"max_tokens": int(rng.integers(1, 17)), "stream": bool(rng.integers(2))}
        body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        if rng.random() < 0.6:
            body["temperature"] = 0
        else:
            body |= {"temperature": float(rng.uniform(0.3, 1.5)), "top_p": float(rng.uniform(0.5, 1.0)),
                     "seed": int(rng.integers(1 << 30))}
        out.append({"chat": chat, "body": body, "i": i})
    return out


async def _one(client: httpx.AsyncClient, req: dict) -> tuple[int, str]:
    path = "/v1/chat/completions" if req["chat"] else "/v1/completions"
    if not req["body"]["stream"]:
        r = await client.post(path, json=req["body"])
        if r.status_code != 200:
            return r.status_code, r.text
        c = r.json()["choices"][0]
        return 200, c["message"]["content"] if req["chat"] else c["text"]
    text = []
    async with client.stream("POST", path, json=req["body"]) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()).decode()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                c = json.loads(line[6:])["choices"][0]
                text.append(c["delta"].get("content", "") if req["chat"] else c["text"])
    return 200, "".join(text)


async def _drive(url: str, reqs: list[dict], rss: list[float]) -> list[tuple[int, str]]:
    sem = asyncio.Semaphore(CONCURRENCY)
    done = 0

    async def run(client, req):
        nonlocal done
        async with sem:
            res = await _one(client, req)
        done += 1
        if done in (WARMUP, REQUESTS):
            rss.append(_rss_mb())
        return res

    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        return await asyncio.gather(*(run(client, r) for r in reqs))


def test_500_mixed_requests_at_concurrency_8(tiny_bundle, tiny_reference):
    scheduler = Scheduler(Generator(tiny_bundle, drafter="ngram", max_seq_len=64, slots=8), max_waiting=64)
    reqs = _requests(np.random.default_rng(7))
    rss: list[float] = []
    with running(create_app(scheduler, "tiny")) as url:
        results = asyncio.run(_drive(url, reqs, rss))
    errors = [(r["body"], res) for r, res in zip(reqs, results, strict=True) if res[0] != 200]
    assert not errors, errors[:3]
    tok, cache = tiny_reference.tokenizer, {}
    greedy = 0
    for r, (_, text) in zip(reqs, results, strict=True):
        b = r["body"]
        if b["temperature"] != 0:
            continue
        greedy += 1
        ids = tok.encode_chat(b["messages"]) if r["chat"] else tok.encode_prompt(b["prompt"], raw=True)
        key = (tuple(ids), b["max_tokens"])
        if key not in cache:
            cache[key] = tok.decode(tiny_reference.generate_ids(ids, b["max_tokens"]).token_ids)
        assert text == cache[key], (r, text, cache[key])
    assert greedy > 250
    assert max(scheduler.batch_sizes) >= 4  # requests really shared verify passes
    growth = rss[1] - rss[0]
    print(f"RSS after {WARMUP} requests {rss[0]:.1f} MB, after {REQUESTS} {rss[1]:.1f} MB; "
          f"{scheduler.steps} verify passes, mean batch {np.mean(scheduler.batch_sizes):.2f}")
    assert growth < 25, f"memory grew {growth:.1f} MB between request {WARMUP} and {REQUESTS}"
