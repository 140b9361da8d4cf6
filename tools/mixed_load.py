"""A mixed load against a running server: chat and completions, streamed and not, greedy and sampled,
of random lengths, from `concurrency` concurrent clients; then every greedy response is held to
single-request plain decoding of the same generator.

`specrt bench-serve --mixed N` runs it on a bundle; tests/serving/test_load.py on the tiny model.
Latency is per request, submit to last byte; RSS is this process's (the loopback server runs in it).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Outcome:
    status: int
    text: str
    seconds: float


@dataclass
class LoadReport:
    requests: int
    concurrency: int
    errors: list = field(default_factory=list)
    greedy: int = 0
    greedy_identical: int = 0
    mismatches: list = field(default_factory=list)
    latency_p50_s: float = 0.0
    latency_p95_s: float = 0.0
    seconds: float = 0.0
    rss_mb: list = field(default_factory=list)  # after the warm-up, and at the end

    def summary(self) -> str:
        return (f"{self.requests} requests at concurrency {self.concurrency}: {len(self.errors)} errors, greedy "
                f"{self.greedy_identical}/{self.greedy} identical to plain; latency p50 {self.latency_p50_s:.2f} s, "
                f"p95 {self.latency_p95_s:.2f} s; {self.seconds:.1f} s; RSS {' → '.join(f'{x:.0f}' for x in self.rss_mb)} MB")


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def mixed_requests(n: int, prompts: list[str], max_tokens: int, rng: np.random.Generator,
                   greedy_share: float = 0.6) -> list[dict]:
    out = []
    for _ in range(n):
        chat = bool(rng.integers(2))
        prompt = prompts[int(rng.integers(len(prompts)))]
        body = {"max_tokens": int(rng.integers(1, max_tokens + 1)), "stream": bool(rng.integers(2))}
        body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        if rng.random() < greedy_share:
            body["temperature"] = 0
        else:
            body |= {"temperature": float(rng.uniform(0.3, 1.5)), "top_p": float(rng.uniform(0.5, 1.0)),
                     "seed": int(rng.integers(1 << 30))}
        out.append({"chat": chat, "body": body})
    return out


async def _one(client, req: dict) -> Outcome:
    path = "/v1/chat/completions" if req["chat"] else "/v1/completions"
    t0 = time.perf_counter()
    if not req["body"]["stream"]:
        r = await client.post(path, json=req["body"])
        if r.status_code != 200:
            return Outcome(r.status_code, r.text, time.perf_counter() - t0)
        c = r.json()["choices"][0]
        return Outcome(200, c["message"]["content"] if req["chat"] else c["text"], time.perf_counter() - t0)
    text = []
    async with client.stream("POST", path, json=req["body"]) as r:
        if r.status_code != 200:
            return Outcome(r.status_code, (await r.aread()).decode(), time.perf_counter() - t0)
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                c = json.loads(line[6:])["choices"][0]
                text.append(c["delta"].get("content", "") if req["chat"] else c["text"])
    return Outcome(200, "".join(text), time.perf_counter() - t0)


async def drive(url: str, reqs: list[dict], concurrency: int, warmup: int, rss: list[float],
                progress=None) -> list[Outcome]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def run(client, req):
        nonlocal done
        async with sem:
            res = await _one(client, req)
        done += 1
        if done in (warmup, len(reqs)):
            rss.append(rss_mb())
        if progress is not None:
            progress.update(1)
        return res

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        return await asyncio.gather(*(run(client, r) for r in reqs))


def _prompt_ids(tok, req: dict) -> tuple[int, ...]:
    b = req["body"]
    return tuple(tok.encode_chat(b["messages"]) if req["chat"] else tok.encode_prompt(b["prompt"], raw=True))


def plain_texts(gen, reqs: list[dict]) -> list[str | None]:
    """Single-request plain greedy text of every greedy request (None for sampled ones), in order: one
    generation per prompt at its longest length (plain greedy output is a prefix of a longer one)."""
    tok = gen.tokenizer
    keys = [(_prompt_ids(tok, r), r["body"]["max_tokens"]) if r["body"]["temperature"] == 0 else None for r in reqs]
    longest: dict[tuple, int] = {}
    for k in filter(None, keys):
        longest[k[0]] = max(longest.get(k[0], 0), k[1])
    full = {ids: gen.generate_ids(list(ids), n).token_ids for ids, n in longest.items()}
    return [None if k is None else tok.decode(full[k[0]][: k[1]]) for k in keys]


def check(reqs: list[dict], outcomes: list[Outcome], reference: list[str | None], report: LoadReport) -> LoadReport:
    """Fill `report` from the outcomes: errors, greedy responses against `reference` (plain_texts), latency."""
    for r, o, want in zip(reqs, outcomes, reference, strict=True):
        if o.status != 200:
            report.errors.append((r["body"], o.status, o.text[:200]))
            continue
        if want is None:  # sampled
            continue
        report.greedy += 1
        if o.text == want:
            report.greedy_identical += 1
        else:
            report.mismatches.append((r["body"], o.text, want))
    lat = np.array([o.seconds for o in outcomes])
    report.latency_p50_s = float(np.percentile(lat, 50))
    report.latency_p95_s = float(np.percentile(lat, 95))
    return report


def serve_mixed(gen, reqs: list[dict], concurrency: int, slots: int | None = None, warmup: int | None = None,
                progress=None):
    """`reqs` through a loopback server over `gen` (its drafter, `slots` KV slots); (report, outcomes,
    scheduler). The report's greedy fields are filled by `check`."""
    from specrt.serving.api import create_app
    from specrt.serving.scheduler import Scheduler
    from specrt.tools.loadgen import loopback_server

    scheduler = Scheduler(gen, max_waiting=len(reqs), max_slots=slots)
    rss: list[float] = []
    with loopback_server(create_app(scheduler, "load")) as url:
        t0 = time.perf_counter()
        outcomes = asyncio.run(drive(url, reqs, concurrency, warmup or len(reqs) // 5, rss, progress))
        seconds = time.perf_counter() - t0
    return LoadReport(len(reqs), concurrency, seconds=seconds, rss_mb=rss), outcomes, scheduler
