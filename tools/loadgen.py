"""`specrt bench-serve`: throughput and latency of the HTTP server at several concurrencies, batched
verify passes against batch-1 serving of the same requests, side by side in one run.

Each configuration starts a fresh scheduler (same Generator, same weights) behind a real loopback
uvicorn server and sends the same requests (greedy, chat) from `concurrency` concurrent clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import numpy as np

from specrt.runtime.generate import Generator
from specrt.serving.api import Limits, create_app
from specrt.serving.http import uvicorn_config
from specrt.serving.scheduler import Scheduler


@contextlib.contextmanager
def loopback_server(app, timeout: float = 60.0, limits: Limits | None = None):
    """`app` served on 127.0.0.1 (a free port) in a background thread, lifespan included, configured as
    `specrt serve` configures it (`limits`: the app's); yields the base URL; shuts the server down on
    exit. The benchmark and the tests use it."""
    import uvicorn

    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", 0, limits or Limits(), "warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the loopback server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


async def _clients(url: str, prompts: list[str], max_tokens: int, concurrency: int) -> list[tuple[float, int]]:
    import httpx

    sem = asyncio.Semaphore(concurrency)

    async def one(client, prompt):
        async with sem:
            t0 = time.perf_counter()
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0})
            r.raise_for_status()
            return time.perf_counter() - t0, r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return await asyncio.gather(*(one(client, p) for p in prompts))


def measure(gen: Generator, prompts: list[str], max_tokens: int, concurrency: int, slots: int) -> dict:
    scheduler = Scheduler(gen, max_waiting=len(prompts), max_slots=slots)
    with loopback_server(create_app(scheduler, "bench")) as url:
        t0 = time.perf_counter()
        done = asyncio.run(_clients(url, prompts, max_tokens, concurrency))
        wall = time.perf_counter() - t0
    lat = np.array([d[0] for d in done])
    tokens = sum(d[1] for d in done)
    return {"concurrency": concurrency, "slots": slots, "requests": len(prompts), "tokens": tokens,
            "seconds": round(wall, 3), "tokens_per_s": round(tokens / wall, 2),
            "latency_p50_s": round(float(np.percentile(lat, 50)), 3),
            "latency_p95_s": round(float(np.percentile(lat, 95)), 3),
            "mean_batch": round(float(np.mean(scheduler.batch_sizes)), 2) if scheduler.batch_sizes else 0.0}


def bench_serve(gen: Generator, prompts: list[str], max_tokens: int, concurrencies: list[int]) -> list[dict]:
    """For each concurrency: batched serving (slots = concurrency) and batch-1 serving, interleaved."""
    measure(gen, prompts[:2], 4, 2, min(2, gen.slots))  # warm-up
    rows = []
    for c in concurrencies:
        batched = measure(gen, prompts, max_tokens, c, min(c, gen.slots))
        single = measure(gen, prompts, max_tokens, c, 1)
        batched["throughput_vs_batch1"] = round(batched["tokens_per_s"] / single["tokens_per_s"], 2)
        batched["p50_latency_vs_batch1"] = round(batched["latency_p50_s"] / single["latency_p50_s"], 2)
        rows += [batched, single]
    return rows


def format_rows(rows: list[dict]) -> str:
    head = "| concurrency | serving | tok/s | p50 latency s | p95 latency s | mean batch | tok/s × batch-1 |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        mode = "batched" if r["slots"] > 1 or "throughput_vs_batch1" in r else "batch-1"
        lines.append(f"| {r['concurrency']} | {mode} ({r['slots']} slots) | {r['tokens_per_s']} | {r['latency_p50_s']} | "
                     f"{r['latency_p95_s']} | {r['mean_batch']} | {r.get('throughput_vs_batch1', '')} |")
    return "\n".join(lines)
