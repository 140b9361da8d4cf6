"""The speculative step loop: propose → verify → accept → commit, each stage timed.

Greedy verification of a chain d1..dk drafted after the last committed token x:

    one target pass over [x, d1, .., dk] gives argmax predictions y0..yk
    accept the longest prefix with d_i == y_{i-1}; n accepted
    commit d1..dn and the bonus token y_n  (so every step emits n + 1 tokens)
    target KV: rows for x, d1..dn stay valid; the rest is rolled back by moving past_len

Each committed token is the target's own argmax given the committed prefix, so the output equals
plain greedy decoding (the drafter "plain" proposes nothing: T = 1 every step).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime.backend_ort import OrtDecoder
from specrt.runtime.drafters import DrafterContext, make_drafter
from specrt.runtime.manifest import Manifest
from specrt.runtime.tokenizer import Tokenizer

STAGES = ("prefill", "propose", "verify", "accept", "commit")


@dataclass
class Stats:
    new_tokens: int = 0
    seconds: float = 0.0
    steps: int = 0  # target passes after prefill
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """τ: tokens committed per target verify pass (accepted drafts + the bonus token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def record(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        for per, count in ((self.drafted_per_position, drafted), (self.accepted_per_position, accepted)):
            per.extend([0] * (count - len(per)))
            for i in range(count):
                per[i] += 1

    def to_dict(self) -> dict:
        return {"new_tokens": self.new_tokens, "seconds": round(self.seconds, 4),
                "tokens_per_s": round(self.tokens_per_s, 2), "steps": self.steps,
                "mean_accepted_len": round(self.mean_accepted_len, 4),
                "acceptance_rate": round(self.acceptance_rate, 4), "drafted": self.drafted,
                "accepted": self.accepted, "accepted_per_position": self.accepted_per_position,
                "drafted_per_position": self.drafted_per_position,
                "stage_seconds": {k: round(v, 4) for k, v in self.stage_seconds.items()}}


@dataclass
class Result:
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS) or "length" (max_new_tokens or KV capacity)
    stats: Stats
    text: str = ""


class _Timer:
    def __init__(self, stats: Stats, stage: str):
        self.stats, self.stage = stats, stage

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.stats.stage_seconds[self.stage] += time.perf_counter() - self.t0


class Generator:
    """Greedy generation with a named drafter over a bundle's target graph (ONNX Runtime, CPU)."""

    def __init__(self, bundle: str | Path, drafter: str = "plain", max_seq_len: int | None = None,
                 threads: int = 2, num_draft_tokens: int = 5, **drafter_options):
        self.bundle = Path(bundle)
        self.manifest = Manifest.load(self.bundle)
        cfg = self.manifest.target.config
        self.capacity = int(max_seq_len or min(2048, cfg.max_position_embeddings))
        if self.capacity < 2:
            raise SpecrtError(f"--max-seq-len {self.capacity} is too small: it must be at least 2")
        self.k = int(num_draft_tokens)
        self.eos = set(cfg.eos_token_ids)
        self.tokenizer = Tokenizer(self.bundle, self.manifest.tokenizer)
        self.target = OrtDecoder(self.manifest.onnx_path(self.bundle, "target"), cfg, self.capacity, threads)
        self.threads = threads
        self.drafter_options = drafter_options
        self._drafters: dict = {}
        self.use(drafter)

    def use(self, drafter: str) -> Generator:
        """Switch drafter (built once, then reused); the target and its KV buffers are shared."""
        if drafter not in self._drafters:
            ctx = DrafterContext(self.bundle, self.manifest, self.capacity, self.threads,
                                 {"max_draft": self.k, **self.drafter_options})
            self._drafters[drafter] = make_drafter(drafter, ctx)
        self.drafter_name, self.drafter = drafter, self._drafters[drafter]
        return self

    # ── the loop ────────────────────────────────────────────────────────────────────────────
    def stream(self, prompt_ids: list[int], max_new_tokens: int = 128) -> Iterator[list[int]]:
        """Yield committed tokens chunk by chunk; the final `Result` is the generator's return value."""
        if not prompt_ids:
            raise SpecrtError("the prompt is empty: give at least one token")
        if len(prompt_ids) >= self.capacity:
            raise SpecrtError(f"the prompt has {len(prompt_ids)} tokens but the KV capacity is {self.capacity}: "
                              "shorten the prompt or raise --max-seq-len")
        stats = Stats()
        t0 = time.perf_counter()
        tokens = list(prompt_ids)
        self.drafter.observe(tokens)
        with _Timer(stats, "prefill"):
            n = len(tokens)
            logits = self._verify(tokens, 0, np.array([[n - 1]], np.int64))
            first = int(logits[0].argmax())
        out: list[int] = []
        finish = self._emit([first], out, tokens, max_new_tokens)
        yield [first]
        while finish is None:
            if len(tokens) > self.capacity:  # no row left for the next pass
                finish = "length"
                break
            room = min(self.k, self.capacity - len(tokens), max_new_tokens - len(out) - 1)
            with _Timer(stats, "propose"):
                draft = self.drafter.propose(tokens, room)[:room] if room > 0 else []
            with _Timer(stats, "verify"):
                window = [tokens[-1], *draft]
                logits = self._verify(window, len(tokens) - 1, np.arange(len(window), dtype=np.int64)[None])
            with _Timer(stats, "accept"):
                predicted = logits.argmax(-1)
                n_acc = 0
                while n_acc < len(draft) and draft[n_acc] == predicted[n_acc]:
                    n_acc += 1
                new = [*draft[:n_acc], int(predicted[n_acc])]
            with _Timer(stats, "commit"):
                stats.record(len(draft), n_acc)
                kept = len(out)
                finish = self._emit(new, out, tokens, max_new_tokens)
                self.drafter.observe(tokens)
            yield out[kept:]
        stats.new_tokens = len(out)
        stats.seconds = time.perf_counter() - t0
        return Result(token_ids=out, finish_reason=finish, stats=stats)

    def _verify(self, window: list[int], past: int, logits_index: np.ndarray) -> np.ndarray:
        """One target pass over `window` written at rows past..; returns logits [R, V]."""
        t = len(window)
        logits, _ = self.target.run(
            np.asarray([window], np.int64), np.arange(past, past + t, dtype=np.int64)[None],
            np.array([past], np.int64), np.tril(np.ones((t, t), bool))[None], logits_index)
        return logits[0]

    def _emit(self, new: list[int], out: list[int], tokens: list[int], max_new_tokens: int) -> str | None:
        """Commit `new` (cut at EOS / max_new_tokens); returns the finish reason once done."""
        for tok in new:
            out.append(tok)
            tokens.append(tok)
            if tok in self.eos:
                return "stop"
            if len(out) >= max_new_tokens:
                return "length"
        return None

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int = 128) -> Result:
        it = self.stream(prompt_ids, max_new_tokens)
        while True:
            try:
                next(it)
            except StopIteration as stop:
                return stop.value

    def generate(self, prompt: str, max_new_tokens: int = 128, raw: bool = False) -> Result:
        result = self.generate_ids(self.tokenizer.encode_prompt(prompt, raw), max_new_tokens)
        result.text = self.tokenizer.decode(result.token_ids)
        return result
