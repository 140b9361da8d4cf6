"""HTTP load against OpenAI-compatible servers, each started alone: `specrt bench-serve --peer vllm`.

Every engine is a server in a process group of its own (`vllm serve` in the vLLM venv, `specrt serve`
in ours) on a free loopback port, up alone so none shares the cores with another, and gets the same
load: the same chat requests (greedy, temperature 0, max_tokens) from `concurrency` concurrent
clients, not streamed and streamed, at each concurrency level. Per engine × concurrency × stream:

    output tok/s   completion tokens of all requests / wall time of the whole level
    latency        p50 / p95 of each request's time from sending to its last byte
    TTFT           p50 / p95 time to first token: streamed, the first chunk carrying content; not
                   streamed, the latency (the whole answer arrives at once)
    ITL            streamed: p50 / p95 of the gaps between consecutive content chunks, over every request
                   (vLLM's benchmark_serving's inter-token latency; a drafted step's tokens share a chunk)
    TPOT           streamed: p50 over requests of (latency − TTFT) / (tokens − 1)
    server RSS     resident memory of the server's process group (Linux /proc) after the level: a
                   server that leaks grows from level to level
    long prompt    (`long_prompt`) each streamed level of several users once more with one long prompt
                   among the requests, queued behind the first `concurrency` so it arrives mid-run: the
                   row's figures are the other requests' (does its prefill stall their streams?), with
                   the long request's own TTFT beside them
    same as single greedy texts equal to the engine's own single-request text (concurrency 1, not
                   streamed): does batching change its output?
    same as plain  specrt only: equal to single-request *plain* decoding (`--drafter plain`), specrt's
                   promise (lossless speculation, batch-invariant serving)

The pure parts (percentiles, equality counts, the table) and the client are unit-tested
(tests/tools/test_serve_bench.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError

START_TIMEOUT_S = 900.0  # a vLLM server's first start compiles its model (minutes on 2 cores)
REQUEST_TIMEOUT_S = 900.0
LOG_TAIL = 15  # lines of a failed server's log quoted in the error
SINGLE = (1, False)  # (concurrency, stream) of the run every other one is compared with


# ---- statistics and the table -------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between order statistics (numpy's default);
    None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not within 0..100")
    return float(np.percentile(values, q)) if values else None


def count_equal(texts: list[str | None], reference: list[str | None]) -> int:
    """How many texts equal the reference text of the same request; a failed request (None) on either
    side never counts."""
    if len(texts) != len(reference):
        raise ValueError(f"{len(texts)} texts against {len(reference)} reference texts")
    return sum(1 for a, b in zip(texts, reference, strict=True) if a is not None and b is not None and a == b)


@dataclass
class Outcome:
    """One request's result: its text (None when it failed), completion tokens, and timings."""

    text: str | None
    tokens: int
    latency_s: float
    ttft_s: float | None
    error: str | None = None
    gaps_s: list[float] = field(default_factory=list)  # streamed: seconds between consecutive content chunks
    prompt_tokens: int | None = None  # as the server's usage counted them, where it says


def summarize(engine: str, concurrency: int, stream: bool, outcomes: list[Outcome], wall_s: float,
              single: list[str | None] | None = None, plain: list[str | None] | None = None) -> dict:
    """One table row: throughput, latency and TTFT percentiles, errors, and equality counts against the
    engine's single-request texts (`single`) and, for specrt, single-request plain decoding (`plain`)."""
    ok = [o for o in outcomes if o.error is None]
    tokens = sum(o.tokens for o in ok)
    texts = [o.text if o.error is None else None for o in outcomes]
    n = len(outcomes)
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    gaps = [g for o in ok for g in o.gaps_s]
    tpots = [(o.latency_s - o.ttft_s) / (o.tokens - 1) for o in ok if o.gaps_s and o.tokens > 1]

    def rounded(x):
        return None if x is None else round(x, 4)

    row = {"engine": engine, "concurrency": concurrency, "stream": stream, "requests": n,
           "errors": n - len(ok), "tokens": tokens, "seconds": round(wall_s, 3),
           "tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
           "latency_p50_s": rounded(percentile([o.latency_s for o in ok], 50)),
           "latency_p95_s": rounded(percentile([o.latency_s for o in ok], 95)),
           "ttft_p50_s": rounded(percentile(ttfts, 50)), "ttft_p95_s": rounded(percentile(ttfts, 95)),
           "itl_p50_s": rounded(percentile(gaps, 50)), "itl_p95_s": rounded(percentile(gaps, 95)),
           "tpot_p50_s": rounded(percentile(tpots, 50)),
           "same_as_single": None if single is None else count_equal(texts, single),
           "same_as_plain": None if plain is None else count_equal(texts, plain)}
    first = next((o.error for o in outcomes if o.error), None)
    if first:
        row["first_error"] = first
    return row


def format_table(rows: list[dict]) -> str:
    """The rows as a Markdown table; equality columns read k/n (blank where not measured)."""
    head = ("| engine | load | stream | tok/s | p50 latency s | p95 latency s | p50 TTFT s | p95 TTFT s "
            "| p50 ITL ms | p95 ITL ms | errors | same as own single | same as plain single | server RSS MB |")
    lines = [head, "|" + "---|" * 14]

    def frac(r, key):
        return "" if r.get(key) is None else f"{r[key]}/{r['requests']}"

    def num(x):
        return "" if x is None else f"{x}"

    def ms(x):
        return "" if x is None else f"{1000 * x:.1f}"

    for r in rows:
        load = f"{r['concurrency']} users" + (f", {r['rate']:g} req/s" if r.get("rate") else "")
        if r.get("long_prompt"):
            load += f" + a {r['long_prompt']['prompt_tokens'] or '?'}-token prompt"
        lines.append(f"| {r['engine']} | {load} | {'yes' if r['stream'] else 'no'} | "
                     f"{num(r['tokens_per_s'])} | {num(r['latency_p50_s'])} | {num(r['latency_p95_s'])} | "
                     f"{num(r['ttft_p50_s'])} | {num(r.get('ttft_p95_s'))} | {ms(r.get('itl_p50_s'))} | "
                     f"{ms(r.get('itl_p95_s'))} | {r['errors']} | {frac(r, 'same_as_single')} | "
                     f"{frac(r, 'same_as_plain')} | {num(r.get('server_rss_mb'))} |")
    return "\n".join(lines)


def write_json(path: str | Path, obj) -> None:
    """Written whole or not at all (a temporary file beside it, then renamed)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, default=str)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---- the client ---------------------------------------------------------------------------------------

def chat_body(model: str, prompt: str, max_tokens: int, stream: bool) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def _sse_events(lines: list[str]) -> Iterator[dict | str]:
    """The JSON objects of SSE `data:` lines (the string "[DONE]" for the end marker)."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        yield "[DONE]" if data == "[DONE]" else json.loads(data)


def _error_of(obj: dict) -> str:
    err = obj.get("error")
    return (err.get("message") if isinstance(err, dict) else None) or str(err)


async def _plain_request(client, body: dict) -> Outcome:
    t0 = time.perf_counter()
    r = await client.post("/v1/chat/completions", json=body)
    latency = time.perf_counter() - t0
    if r.status_code != 200:
        return Outcome(None, 0, latency, None, f"HTTP {r.status_code}: {r.text[:200]}")
    obj = r.json()
    text = obj["choices"][0]["message"].get("content") or ""
    usage = obj.get("usage") or {}
    return Outcome(text, int(usage.get("completion_tokens", 0)), latency, latency,
                   prompt_tokens=usage.get("prompt_tokens"))


async def _stream_request(client, body: dict) -> Outcome:
    t0 = time.perf_counter()
    ttft, pieces, tokens, chunks, done, gaps, last, prompt_tokens = None, [], None, 0, False, [], None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return Outcome(None, 0, time.perf_counter() - t0, None, f"HTTP {r.status_code}: {r.text[:200]}")
        async for line in r.aiter_lines():
            for ev in _sse_events([line]):
                if ev == "[DONE]":
                    done = True
                    continue
                if "error" in ev:
                    return Outcome(None, 0, time.perf_counter() - t0, ttft, f"stream error: {_error_of(ev)}")
                for choice in ev.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        now = time.perf_counter()
                        if ttft is None:
                            ttft = now - t0
                        else:
                            gaps.append(now - last)
                        last = now
                        pieces.append(piece)
                        chunks += 1
                if ev.get("usage"):
                    tokens = int(ev["usage"].get("completion_tokens", 0))
                    prompt_tokens = ev["usage"].get("prompt_tokens")
    latency = time.perf_counter() - t0
    if not done:
        return Outcome(None, 0, latency, ttft, "the stream ended without `data: [DONE]`")
    # without a usage chunk, a content chunk counts as one token (servers stream about one per token)
    return Outcome("".join(pieces), chunks if tokens is None else tokens, latency, ttft, gaps_s=gaps,
                   prompt_tokens=prompt_tokens)


async def one_request(client, model: str, prompt: str, max_tokens: int, stream: bool) -> Outcome:
    """One greedy chat completion; a failure (HTTP status, transport, a stream's error event) becomes
    an Outcome with `error` set rather than an exception, so one failed request never ends a level."""
    body = chat_body(model, prompt, max_tokens, stream)
    t0 = time.perf_counter()
    try:
        return await (_stream_request if stream else _plain_request)(client, body)
    except Exception as e:  # httpx transport errors, malformed JSON
        return Outcome(None, 0, time.perf_counter() - t0, None, f"{type(e).__name__}: {e}")


def long_prompt(tokens: int, prompts: list[str]) -> str:
    """About `tokens` tokens of text (4 characters a token: English runs 4 to 5 in BPE vocabularies), the
    load's own prompts one after another, then a request to summarize them: one long prompt a user sends."""
    if tokens < 1 or not prompts:
        raise SpecrtError(f"--long-prompt {tokens}: give a positive token count (and a load with prompts)")
    parts, size, i = [], 0, 0
    while size < 4 * tokens:
        parts.append(prompts[i % len(prompts)])
        size += len(parts[-1]) + 1
        i += 1
    return "\n".join(parts)[: 4 * tokens] + "\n\nSummarize the text above in one sentence."


def arrivals(n: int, rate: float | None, seed: int = 0) -> list[float]:
    """When each of `n` requests is sent, in seconds from the start: a Poisson process of `rate` requests
    a second (exponential gaps, seeded: every engine gets the same schedule), or all at 0 (None)."""
    if rate is None:
        return [0.0] * n
    if not rate > 0:
        raise SpecrtError(f"--rate {rate}: give requests per second above 0")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.concatenate([[0.0], np.cumsum(gaps[1:])]).tolist()


async def drive(url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int, stream: bool,
                progress=None, timeout: float = REQUEST_TIMEOUT_S, rate: float | None = None
                ) -> tuple[list[Outcome], float]:
    """Every prompt as one request, at most `concurrency` in flight, sent as they arrive (`rate`: a
    Poisson process of that many a second; None: all at once); (outcomes in prompt order, wall s)."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    schedule = arrivals(len(prompts), rate)

    async def one(client, prompt, at):
        if at > 0:
            await asyncio.sleep(at - (time.perf_counter() - t0))  # the arrival schedule: a load, not a verdict
        async with sem:
            out = await one_request(client, model, prompt, max_tokens, stream)
        if progress is not None:
            progress.update(1)
        return out

    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(one(client, p, at) for p, at in zip(prompts, schedule, strict=True)))
        return list(outcomes), time.perf_counter() - t0


def run_load(url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int, stream: bool,
             progress=None, rate: float | None = None) -> tuple[list[Outcome], float]:
    return asyncio.run(drive(url, model, prompts, max_tokens, concurrency, stream, progress, rate=rate))


# ---- servers --------------------------------------------------------------------------------------------

def free_port() -> int:
    """A loopback port free now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").strip().splitlines()[-LOG_TAIL:]
    except OSError:
        lines = []
    return (f"; its log {log} ends:\n" + "\n".join(lines)) if lines else f" (its log {log} is empty)"


def wait_ready(url: str, proc: subprocess.Popen, log: Path, name: str, timeout: float) -> str:
    """Poll GET /v1/models until the server answers; returns the model id it serves. Refused, quoting
    the log, when the process exits first or the timeout passes."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise SpecrtError(f"{name}: the server exited with code {proc.returncode} before it answered "
                              f"{url}/v1/models{_tail(log)}")
        try:
            r = httpx.get(f"{url}/v1/models", timeout=5)
            if r.status_code == 200 and r.json().get("data"):
                return r.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise SpecrtError(f"{name}: the server did not answer {url}/v1/models within {timeout:.0f} s{_tail(log)}")
        time.sleep(1.0)


def stop_group(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """End the server's whole process group (vLLM's engine core and workers too): SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):  # children left behind by a leader that already exited
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def group_rss_mb(pgid: int, proc_root: Path = Path("/proc")) -> float | None:
    """Resident memory of every process in group `pgid`, MB (a server and the workers it started); None
    where /proc cannot tell (not Linux)."""
    total, seen = 0, False
    try:
        entries = list(proc_root.iterdir())
    except OSError:
        return None
    for d in entries:
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses, so split after the last ")"
            if int(stat[stat.rindex(")") + 2:].split()[2]) != pgid:
                continue
            for line in (d / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
                    seen = True
        except (OSError, ValueError, IndexError):
            continue  # a process that ended meanwhile
    return round(total / 1024, 1) if seen else None


@contextlib.contextmanager
def server(name: str, argv: list[str], port: int, env: dict[str, str] | None = None,
           timeout: float = START_TIMEOUT_S, log_dir: Path | None = None,
           started: Callable[[int], None] | None = None) -> Iterator[tuple[str, str]]:
    """`argv` (a server listening on 127.0.0.1:`port`) started in a process group of its own, its output
    in a log file; yields (base URL, model id) once it answers; its group is ended on exit. `started`
    gets the group's id."""
    fd, log = tempfile.mkstemp(prefix=f"specrt-serve-bench-{name}-", suffix=".log", dir=log_dir)
    log = Path(log)
    with os.fdopen(fd, "wb") as out:
        proc = subprocess.Popen(argv, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    if started is not None:
        started(proc.pid)  # a new session: the group's id is the leader's pid
    try:
        url = f"http://127.0.0.1:{port}"
        yield url, wait_ready(url, proc, log, name, timeout)
    finally:
        stop_group(proc)
    log.unlink(missing_ok=True)  # kept when the run failed (an exception skips this line)


def specrt_serve_command(bundle: Path, port: int, slots: int, drafter: str | None, flags: list[str],
                         specrt: str | None = None) -> list[str]:
    """`specrt serve` on loopback with `slots` KV slots and `drafter` (None: the bundle's tuned choice);
    `flags`: runtime options passed on as given (e.g. ["--threads", "2"])."""
    exe = specrt or str(Path(sys.executable).with_name("specrt"))
    return [exe, "serve", str(bundle), "--host", "127.0.0.1", "--port", str(port), "--slots", str(slots),
            *(["--drafter", drafter] if drafter else []), "--max-waiting", str(max(64, slots * 2)),
            "--log-level", "warning", *flags]


# ---- one engine, every level --------------------------------------------------------------------------------

@dataclass
class Engine:
    """A server to measure: `start(port)` -> (argv, extra env); `levels`: (concurrency, stream) runs."""

    name: str
    start: Callable[[int], tuple[list[str], dict[str, str]]]
    levels: list[tuple[int, bool]]


def levels_of(concurrencies: list[int], streams: tuple[bool, ...] = (False, True)) -> list[tuple[int, bool]]:
    """(concurrency, stream) runs, the single-request reference SINGLE first (added when absent)."""
    runs = [(c, s) for c in concurrencies for s in streams]
    return [SINGLE] + [r for r in runs if r != SINGLE]


def intruded(prompts: list[str], long: str, concurrency: int) -> tuple[list[str], int]:
    """The load with `long` queued behind the first `concurrency` requests (sent when one of them ends:
    mid-run), and its index."""
    at = min(concurrency, len(prompts))
    return prompts[:at] + [long] + prompts[at:], at


def measure_engine(engine: Engine, prompts: list[str], max_tokens: int, log=print, bar: Callable | None = None,
                   record: dict | None = None, rate: float | None = None, rss: dict | None = None,
                   long: str | None = None, long_runs: dict | None = None
                   ) -> dict[tuple[int, bool], tuple[list[Outcome], float]]:
    """Start `engine`'s server alone, warm it up (one short request, not measured), run every level
    (`rate`: requests arriving as a Poisson process, but for the SINGLE reference, sent one by one);
    `record` gets the command line and environment it ran with, `rss` the server's resident MB after
    the warm-up ("warm") and after each level. `long`: each streamed level of several users runs again with
    this prompt among its requests (`intruded`); `long_runs` gets (others' outcomes, wall s, the long
    request's outcome) by level."""
    port = free_port()
    argv, env = engine.start(port)
    if record is not None:
        record[engine.name] = {"argv": argv, "env": env}
    log(f"{engine.name}: starting {' '.join(argv[:4])}... on port {port}")
    t0 = time.perf_counter()
    results = {}
    group: list[int] = []
    rss = {} if rss is None else rss
    with server(engine.name, argv, port, env, started=group.append) as (url, model):
        log(f"{engine.name}: up in {time.perf_counter() - t0:.0f} s, serving {model!r}")
        warm, _ = run_load(url, model, prompts[:1], 4, 1, False)
        if warm[0].error:
            raise SpecrtError(f"{engine.name}: the warm-up request failed: {warm[0].error}")
        rss["warm"] = group_rss_mb(group[0])
        for c, stream in engine.levels:
            progress = bar(total=len(prompts), desc=f"{engine.name} c={c}{' stream' if stream else ''}",
                           unit="req", leave=False) if bar else None
            try:
                results[(c, stream)] = run_load(url, model, prompts, max_tokens, c, stream, progress,
                                                None if (c, stream) == SINGLE else rate)
            finally:
                if progress is not None:
                    progress.close()
            rss[(c, stream)] = group_rss_mb(group[0])
            if long is not None and stream and c > 1 and long_runs is not None:
                load, at = intruded(prompts, long, c)
                outs, wall = run_load(url, model, load, max_tokens, c, stream, None, rate)
                long_runs[(c, stream)] = (outs[:at] + outs[at + 1:], wall, outs[at])
    return results


def rows_of(name: str, results: dict, plain: list[str | None] | None = None, rate: float | None = None,
            rss: dict | None = None, long_runs: dict | None = None) -> list[dict]:
    """Table rows of one engine's results, each compared with its SINGLE run (and `plain`, where given);
    `rate`: the arrival rate of every run but SINGLE; `rss`: the server's MB after each level; `long_runs`:
    a row after its level's for the run with a long prompt among the requests (the others' figures)."""
    single = [o.text if o.error is None else None for o in results[SINGLE][0]]
    rows = []
    for (c, s), (outs, wall) in results.items():
        rows.append(summarize(name, c, s, outs, wall, single, plain))
        rows[-1]["rate"] = None if (c, s) == SINGLE else rate
        rows[-1]["server_rss_mb"] = (rss or {}).get((c, s))
        if (c, s) in (long_runs or {}):
            others, wall, long = long_runs[(c, s)]
            rows.append(summarize(name, c, s, others, wall, single, plain))
            rows[-1]["rate"] = rows[-2]["rate"]
            rows[-1]["long_prompt"] = {"prompt_tokens": long.prompt_tokens, "ttft_s": long.ttft_s,
                                       "latency_s": round(long.latency_s, 4), "error": long.error}
    return rows


def texts_of(outcomes: list[Outcome]) -> list[str | None]:
    return [o.text if o.error is None else None for o in outcomes]


def outcomes_json(results: dict) -> list[dict]:
    return [{"concurrency": c, "stream": s, "outcomes": [asdict(o) for o in outs]}
            for (c, s), (outs, _) in results.items()]


# ---- the comparison `specrt bench-serve --peer` runs ---------------------------------------------------------

def vllm_engine(bundle: Path, threads: int, max_seq_len: int | None, levels: list[tuple[int, bool]]) -> Engine:
    """`vllm serve` (its OpenAI server module, in the vLLM venv) on the bundle source's HF folder, bf16."""
    from specrt.schema.manifest import Manifest
    from specrt.tools.peer_models import ensure_hf_folder
    from specrt.tools.peers_vllm import DTYPE, context_length, serve_command, vllm_python

    python = vllm_python()  # refused first, naming `make setup-peers`, when the venv is absent
    manifest = Manifest.load(bundle)
    folder = ensure_hf_folder(manifest.target.source)
    context = context_length(max_seq_len, manifest.target.config.max_position_embeddings)
    return Engine(f"vllm-{DTYPE}", lambda port: serve_command(python, folder, port, threads, context), levels)


SERVERS: dict[str, Callable[..., Engine]] = {"vllm": vllm_engine}  # --peer NAME: (bundle, threads, max_seq_len, levels)


def tuned_drafter(bundle: Path) -> str:
    """The drafter `specrt serve` picks when none is given: the bundle's tuned choice, else plain."""
    from specrt.schema.manifest import Manifest

    return Manifest.load(bundle).runtime_defaults.get("drafter", "plain")


def compare(bundle: Path, peer: str | None, drafter: str | None, prompts: list[str], max_tokens: int,
            concurrencies: list[int], threads: int, max_seq_len: int | None, flags: list[str],
            log=print, bar: Callable | None = None, rate: float | None = None, long_tokens: int | None = None) -> dict:
    """The peer's server (None: none), then specrt's single-request plain reference, then `specrt serve
    --drafter DRAFTER`, one at a time, under the same load; {"rows", "config", "outcomes"}."""
    if peer is not None and peer not in SERVERS:
        raise SpecrtError(f"unknown --peer {peer!r}: choose from {', '.join(SERVERS)}")
    levels = levels_of(concurrencies)
    # refused first when the peer is not set up
    other = SERVERS[peer](bundle, threads, max_seq_len, levels) if peer is not None else None
    slots = max(concurrencies)
    chosen = drafter or tuned_drafter(bundle)

    def specrt_engine(name: str, drafter_flag: str | None, engine_slots: int, runs) -> Engine:
        return Engine(name, lambda port: (specrt_serve_command(bundle, port, engine_slots, drafter_flag, flags), {}),
                      runs)

    engines = [other] if other is not None else []
    if chosen != "plain":
        # as many slots as the served engine: the same graph and execution mode, so the same reference
        # (on ort-fused a batch-1 server runs another graph: runtime/reference.py)
        engines.append(specrt_engine("specrt-plain", "plain", slots, [SINGLE]))
    engines.append(specrt_engine(f"specrt-{chosen}", drafter, slots, levels))
    commands: dict = {}
    rss: dict[str, dict] = {e.name: {} for e in engines}
    long = long_prompt(long_tokens, prompts) if long_tokens else None
    long_runs: dict[str, dict] = {e.name: {} for e in engines}
    results = {e.name: measure_engine(e, prompts, max_tokens, log, bar, commands, rate, rss[e.name], long,
                                      long_runs[e.name]) for e in engines}
    plain = texts_of(results["specrt-plain" if chosen != "plain" else f"specrt-{chosen}"][SINGLE][0])
    rows = (rows_of(other.name, results[other.name], rate=rate, rss=rss[other.name], long_runs=long_runs[other.name])
            if other is not None else [])
    for e in engines[1 if other is not None else 0:]:
        rows += rows_of(e.name, results[e.name], plain, rate, rss[e.name], long_runs[e.name])
    config = {"peer": peer, "bundle": str(bundle), "drafter": chosen, "threads": threads, "max_tokens": max_tokens,
              "requests": len(prompts), "concurrencies": concurrencies, "rate": rate, "specrt_slots": slots,
              "flags": flags, "commands": commands, "long_prompt_tokens": long_tokens,
              "server_rss_mb_after_warmup": {name: r.get("warm") for name, r in rss.items()}}
    return {"config": config, "rows": rows,
            "outcomes": {name: outcomes_json(res) for name, res in results.items()}}
