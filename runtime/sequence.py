"""One request's speculative decoding, as steps an outer loop drives: the loop owns the target passes.

    seq = Sequence(...)
    seq.prefilled(logits, outs)             after the prefill pass over seq.prefill_pass()
    while (p := seq.plan()) is not None:    propose: the verify window of this step
        seq.commit(p, logits, outs)         accept + commit after the verify pass over p

`Generator.stream` drives one sequence with batch-1 passes; the serving scheduler (runtime/serving/)
drives many with one batched verify pass per step. Both run exactly this code, so a served request
commits the same tokens as `specrt generate` would.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from specrt.errors import SpecrtError
from specrt.plugins.rejection_sample import sample_from
from specrt.runtime.acceptance import LOSSY, Window, acceptance_for
from specrt.runtime.adaptive import AdaptiveDepth
from specrt.runtime.drafters import Drafter, Proposal
from specrt.runtime.drafters.features import TargetState
from specrt.runtime.sampling import SamplingParams, warp
from specrt.runtime.stats import Result, Stats, Timer
from specrt.runtime.tree import Tree


@dataclass
class Pass:
    """One target pass a sequence asks for: `window` written at KV rows past.., logits for `rows`."""

    window: np.ndarray  # [T] int64
    past: int
    tree: Tree
    rows: np.ndarray  # window rows whose logits are needed
    proposal: Proposal | None = None
    depth: int = 0  # draft depth limit chosen for this step
    propose_seconds: float = 0.0


def pack_windows(plans: list[Pass | None]) -> tuple[np.ndarray, ...]:
    """The inputs (input_ids, position_ids, past_len, tree_mask, logits_index) of one target pass over
    consecutive KV slots, one plan per slot. Windows are padded to the longest: padding rows sit at the
    root's position and see only themselves; a `None` plan (an idle slot) is a dummy window at row 0."""
    live = [p for p in plans if p is not None]
    t, r, n = max(len(p.window) for p in live), max(len(p.rows) for p in live), len(plans)
    ids = np.zeros((n, t), np.int64)
    pos = np.zeros((n, t), np.int64)
    past = np.zeros(n, np.int64)
    mask = np.broadcast_to(np.eye(t, dtype=bool), (n, t, t)).copy()
    rows = np.zeros((n, r), np.int64)
    for i, p in enumerate(plans):
        if p is None:
            continue
        m = len(p.window)
        ids[i, :m] = p.window
        pos[i] = p.past + np.pad(p.tree.depth, (0, t - m))
        past[i] = p.past
        mask[i, :m, :m] = p.tree.mask
        rows[i, : len(p.rows)] = p.rows
    return ids, pos, past, mask, rows


def check_prompt(prompt_ids: list[int], capacity: int) -> None:
    if not prompt_ids:
        raise SpecrtError("the prompt is empty: give at least one token")
    if len(prompt_ids) >= capacity:
        raise SpecrtError(f"the prompt has {len(prompt_ids)} tokens but the KV capacity is {capacity}: "
                          "shorten the prompt or raise --max-seq-len")


def pick(logits: np.ndarray, sampling: SamplingParams, rng: np.random.Generator) -> int:
    if sampling.greedy:
        return int(logits.argmax())
    return sample_from(warp(logits, sampling), float(rng.random(dtype=np.float32)))


class Sequence:
    """State of one generation: committed tokens, output, stats, and the drafter and target state it uses
    (each sequence needs its own when several run at once). `compact(dst, rows)` moves this sequence's
    KV rows in the target's cache."""

    def __init__(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams | None,
                 acceptance: str | None, drafter: Drafter, state: TargetState, capacity: int, eos: set[int],
                 compact: Callable[[int, list[int]], None], control: AdaptiveDepth | None = None,
                 max_nodes: int | None = None, exact: bool = True):
        """`exact`: whether the target's passes give plain decoding's rows here (runtime/exactness.py)."""
        self.sampling = sampling or SamplingParams()
        self.rule_name, self.rule = acceptance_for(acceptance, self.sampling)
        check_prompt(prompt_ids, capacity)
        self.rng = np.random.default_rng(self.sampling.seed)
        self.drafter, self.state, self.capacity, self.eos = drafter, state, capacity, eos
        self.compact, self.control = compact, control
        self.node_limit = max_nodes  # drafted nodes per step at most (a batched pass's padding room)
        self.needs_hidden = getattr(drafter, "needs_hidden", False)
        self.max_new_tokens = max_new_tokens
        self.exact = exact
        self.tokens = list(prompt_ids)
        self.out: list[int] = []
        self.finish: str | None = None
        self.stats = Stats()
        self.t0 = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.finish is not None

    # ── prefill ─────────────────────────────────────────────────────────────────────────────
    def prefill_pass(self) -> Pass:
        n = len(self.tokens)
        return Pass(np.asarray(self.tokens, np.int64), 0, Tree.chain(n - 1), np.array([n - 1]))

    def prefilled(self, logits: np.ndarray, outs: dict, seconds: float = 0.0) -> list[int]:
        """After the prefill pass (`logits` [1, V] of the last prompt row): the first token."""
        with Timer(self.stats, "prefill"):
            first = pick(logits[0], self.sampling, self.rng)
            if self.needs_hidden:
                n = len(self.tokens)
                self.state.write(np.arange(n), outs, np.arange(n))
            self.finish = self._emit([first])
            self.drafter.observe(self.tokens, self.state)
        self.stats.stage_seconds["prefill"] += seconds
        return [first]

    # ── steps ───────────────────────────────────────────────────────────────────────────────
    def plan(self) -> Pass | None:
        """Propose this step's draft; the verify window, or None once the sequence is finished."""
        if self.finish is None and len(self.tokens) > self.capacity:  # no row left for the next pass
            self.finish = "length"
        if self.finish is not None:
            return None
        tokens = self.tokens
        max_nodes = self.capacity - len(tokens)  # KV rows left after the root's
        if self.node_limit is not None:
            max_nodes = min(max_nodes, self.node_limit)
        max_depth = self.max_new_tokens - len(self.out) - 1  # the bonus token needs one more
        depth = min(self.control.choose().depth, max_depth) if self.control else max_depth
        with Timer(self.stats, "propose") as t:
            prop = Proposal()
            if depth > 0:  # depth 0: adaptive chose a plain step
                prop = self.drafter.propose(tokens, max_nodes, depth, self.sampling, self.rng)
            prop = prop.limited(max_nodes, depth)
            tree = prop.tree()
            window = np.asarray([tokens[-1], *prop.tokens], np.int64)
        return Pass(window, len(tokens) - 1, tree, np.arange(tree.size), prop, depth, t.elapsed)

    def commit(self, p: Pass, logits: np.ndarray, outs: dict, verify_seconds: float = 0.0) -> list[int]:
        """Accept and commit after the verify pass over `p` (`logits` [T, V]); the new tokens."""
        self.stats.stage_seconds["verify"] += verify_seconds
        prop, tree, window, past = p.proposal, p.tree, p.window, p.past
        with Timer(self.stats, "accept"):
            q = None if prop.q is None else np.concatenate([np.zeros_like(prop.q[:1]), prop.q])
            path, nxt = self.rule(Window(window, tree, q), logits, self.sampling, self.rng)
            new = [*window[path].tolist(), nxt]
        with Timer(self.stats, "commit"):
            rows = [past + n for n in path]
            if rows != list(range(past + 1, past + 1 + len(path))):
                self.compact(past + 1, rows)
            if self.needs_hidden:  # the root's and the accepted nodes' target states
                self.state.write(np.arange(past, past + 1 + len(path)), outs, [0, *path])
            self.stats.record(len(prop), len(path))
            if self.control:
                self.stats.depth_sum += p.depth
                self.stats.plain_steps += p.depth == 0
                self.control.update(p.depth, tree.depth[1:], len(path), p.propose_seconds, verify_seconds)
            kept = len(self.out)
            self.finish = self._emit(new)
            self.drafter.observe(self.tokens, self.state)
        return self.out[kept:]

    def cancel(self, reason: str = "cancelled") -> None:
        self.finish = self.finish or reason

    def result(self) -> Result:
        self.stats.new_tokens = len(self.out)
        self.stats.seconds = time.perf_counter() - self.t0
        lossy = self.rule_name in LOSSY
        return Result(token_ids=self.out, finish_reason=self.finish or "length", stats=self.stats,
                      lossy=lossy, lossless=self.exact and not lossy)

    def _emit(self, new: list[int]) -> str | None:
        """Commit `new` (cut at EOS / max_new_tokens); returns the finish reason once done."""
        for tok in new:
            self.out.append(tok)
            self.tokens.append(tok)
            if tok in self.eos:
                return "stop"
            if len(self.out) >= self.max_new_tokens:
                return "length"
        return None
