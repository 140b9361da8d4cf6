"""One request's speculative decoding, as steps an outer loop drives: the loop owns the target passes.

    seq = Sequence(request, terms, drafter, state, compact)    runtime/settings.py: Request, SequenceTerms
    seq.prefill(run)                        the prompt's passes; the first token
    while (new := seq.step(run)) is not None:
        ...                                 propose → verify → accept → commit (see "the step" below)

`run(pass) -> outputs` is one batch-1 target pass (`Generator.run_pass`). The serving scheduler
(serving/) batches the verify pass over many sequences instead, so it calls the halves of a
step itself: `p = seq.plan()` (propose), its batched pass (verify), `seq.commit(p, logits, outs)`
(accept + commit). Both run exactly this code, so a served request commits the same tokens as
`specrt generate` would.
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
from specrt.runtime.clock import Clock
from specrt.runtime.drafters import Drafter, Proposal
from specrt.runtime.drafters.features import TargetState
from specrt.runtime.logits import TokenLogprob, biased, token_logprobs
from specrt.runtime.sampling import SamplingParams, warp
from specrt.runtime.settings import Request, SequenceTerms
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
    capped: bool = False  # the scheduler capped this step's depth (not the adaptive controller's choice)


# Prompt rows per prefill pass (see Sequence.prefill_passes). The serving scheduler runs PREFILL_CHUNK rows
# between decode steps, which bounds how long one prompt delays the other sequences; batch-1 generation
# (Sequence.prefill) has no one to wait and runs GENERATE_PREFILL_CHUNK: fewer, larger passes (a 2,000-token
# prompt prefilled 5-6 % faster than in 64-row chunks on both ONNX Runtime backends, 256 no faster). Chunk
# sizes change no bit where the target's passes are exact (tests/runtime/test_lossless_real.py).
PREFILL_CHUNK = 64
GENERATE_PREFILL_CHUNK = 128
RunPass = Callable[[Pass], dict]  # one batch-1 target pass: {"logits": [1, R, V], "hidden_states": [1, T, H], ...}


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


def pack_one(p: Pass) -> tuple[np.ndarray, ...]:
    """`pack_windows([p])` for one window, built from the plan's own arrays (the tree's are shared and
    read-only): the batch-1 pass runs after a target pass has evicted the caches, where each array numpy
    makes costs several microseconds."""
    m = len(p.window)
    window = np.asarray(p.window, np.int64)
    return (window.reshape(1, m), (p.tree.depth + p.past).reshape(1, m), np.full(1, p.past, np.int64),
            p.tree.mask.reshape(1, m, m), np.asarray(p.rows, np.int64).reshape(1, -1))


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

    def __init__(self, request: Request, terms: SequenceTerms, drafter: Drafter, state: TargetState,
                 compact: Callable[[int, list[int]], None], control: AdaptiveDepth | None = None,
                 max_nodes: int | None = None, clock: Clock = time.perf_counter):
        """`request`: the prompt and its terms; `terms`: what the target holds it to (runtime/settings.py);
        `drafter` and `state` are this sequence's own while it runs; `control` its adaptive-depth
        controller (None: fixed depth); `max_nodes`: drafted nodes per step at most (a batched pass's
        padding room); `clock`: what its stage seconds, and so `control`'s costs, are measured by
        (runtime/clock.py)."""
        self.request, self.terms = request, terms
        self.sampling = request.sampling or SamplingParams()
        self.rule_name, self.rule = acceptance_for(terms.acceptance, self.sampling)
        check_prompt(request.prompt_ids, terms.capacity)
        self.rng = np.random.default_rng(self.sampling.seed)
        self.drafter, self.state, self.capacity, self.eos = drafter, state, terms.capacity, terms.eos
        self.compact, self.control = compact, control
        self.node_limit = max_nodes
        self.needs_hidden = drafter.needs_hidden
        self.max_new_tokens = request.max_new_tokens
        self.exact = terms.exact
        self.chains_only = terms.chains_only
        self.logit_bias, self.top_logprobs = dict(request.logit_bias or {}), request.logprobs
        self.tokens = list(request.prompt_ids)
        self.out: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # one per committed token when `logprobs` is set
        self.finish: str | None = None
        self.stats = Stats()
        self.clock = clock
        self.t0 = clock()

    @property
    def done(self) -> bool:
        return self.finish is not None

    # ── prefill ─────────────────────────────────────────────────────────────────────────────
    def prefill(self, run: RunPass, chunk: int | None = None) -> list[int]:
        """The prompt's passes (KV rows 0..n-1, in chunks of `chunk` rows, default GENERATE_PREFILL_CHUNK)
        through `run`; the first token."""
        t0 = self.clock()
        return self.prefilled(self.run_prefill(run, chunk), self.clock() - t0)

    def run_prefill(self, run: RunPass, chunk: int | None = None) -> np.ndarray:
        """The prompt's passes through `run` (chunks of `chunk` rows, default GENERATE_PREFILL_CHUNK), their
        features kept; the last prompt row's logits [1, V]."""
        for p in self.prefill_passes(chunk or GENERATE_PREFILL_CHUNK):
            outs = run(p)
            self.absorb(p, outs)
        return outs["logits"][0]

    def prefill_passes(self, chunk: int | None = None, start: int = 0) -> list[Pass]:
        """The prompt from row `start` on (the rows before it already in the KV cache: the serving prefix
        cache's) as causal chunks of at most `chunk` rows (default PREFILL_CHUNK, the serving scheduler's),
        in order, each written at KV rows after the previous one's; only the last row of each asks for
        logits. A chunk's rows are computed as a whole-prompt pass computes them (the same rows as a verify
        chain), so chunking changes no bit where the target's passes are exact, and it keeps a long
        prompt's attention scores at chunk × context instead of context²."""
        size = chunk or PREFILL_CHUNK
        if not 0 <= start < len(self.tokens):
            raise SpecrtError(f"internal: prefill from row {start} of a {len(self.tokens)}-token prompt")
        tokens = np.asarray(self.tokens, np.int64)
        chunks = [(s, tokens[s : s + size]) for s in range(start, len(tokens), size)]
        return [Pass(c, s, Tree.chain(len(c) - 1), np.array([len(c) - 1])) for s, c in chunks]

    def absorb(self, p: Pass, outs: dict) -> None:
        """After one prefill pass: keep the target features its rows give a feature drafter."""
        if self.needs_hidden:
            rows = np.arange(len(p.window))
            self.state.write(p.past + rows, outs, rows)

    def prefilled(self, logits: np.ndarray, seconds: float = 0.0) -> list[int]:
        """After the last prefill pass (`logits` [1, V] of the last prompt row): the first token."""
        with Timer(self.stats, "prefill", self.clock):
            logits = biased(logits, self.logit_bias)
            first = pick(logits[0], self.sampling, self.rng)
            self.finish = self._emit([first])
            self._read_logprobs(logits[:1], [first])
            self.drafter.observe(self.tokens, self.state)
        self.stats.stage_seconds["prefill"] += seconds
        return [first]

    # ── the step: propose → verify → accept → commit ────────────────────────────────────────────
    #
    # x is the last committed token (its KV row `past` = len(tokens) - 1 is not written yet: x came out
    # of the previous step). p(·|s) is the target's next-token distribution after s, warped by
    # temperature / top-k / top-p (runtime/sampling.py); q the drafter's, warped the same way.
    #
    # 1. propose  The drafter drafts a tree of N tokens after x (a chain is the one-path tree), at most
    #             `depth` deep and no more nodes than KV rows are left. Window = [x, d1, .., dN]: node 0
    #             is the root x, parents come before children, siblings in rank order.
    # 2. verify   ONE target pass over the window, written at KV rows past.., positions past + depth(i),
    #             tree mask: node i sees the prefix, its ancestors and itself. Logits row i is then
    #             p(·| prefix, x, path to i), exactly as plain decoding would compute it after that path
    #             (bitwise where the machine's kernels are batch-invariant: runtime/exactness.py).
    # 3. accept   An acceptance rule (runtime/acceptance.py, the specrt::GreedyAccept/RejectionSample
    #             ops) walks the tree from the root; see `_accept`. It returns the accepted nodes
    #             `path` (root excluded, by depth) and one more token `nxt`: A + 1 tokens committed per
    #             pass, A = len(path) >= 0, so a step never commits less than plain decoding.
    # 4. commit   Append window[path] + [nxt]; move the accepted nodes' KV rows to the front of the new
    #             region and roll back the rest by moving past_len (see `_commit_kv`); tell the drafter.

    def step(self, run: RunPass) -> list[int] | None:
        """One whole step with a batch-1 target pass `run`; the tokens committed, None once finished."""
        p = self.plan()  # 1. propose
        if p is None:
            return None
        t0 = self.clock()
        outs = run(p)  # 2. verify
        return self.commit(p, outs["logits"][0], outs, self.clock() - t0)  # 3. accept, 4. commit

    def plan(self, depth_cap: int | None = None) -> Pass | None:
        """1. propose: this step's draft as the verify window, or None once the sequence is finished.
        `depth_cap`: draft at most that deep this step (the serving scheduler's 0: a plain row in a
        batched pass); a capped step teaches the adaptive controller nothing."""
        if self.finish is None and len(self.tokens) > self.capacity:  # no KV row left for the root
            self.finish = "length"
        if self.finish is not None:
            return None
        max_nodes = self.capacity - len(self.tokens)  # KV rows left after the root's
        if self.node_limit is not None:
            max_nodes = min(max_nodes, self.node_limit)
        max_depth = self.max_new_tokens - len(self.out) - 1  # the bonus token needs one more
        capped = depth_cap is not None and depth_cap < max_depth
        if capped:
            max_depth = depth_cap
        depth = min(self.control.choose().depth, max_depth) if self.control and not capped else max_depth
        with Timer(self.stats, "propose", self.clock) as t:
            prop = Proposal()  # depth 0 (adaptive chose a plain step, or one token is left): no draft
            if depth > 0:
                calls = self.drafter.engine_calls
                prop = self.drafter.propose(self.tokens, max_nodes, depth, self.sampling, self.rng)
                self.stats.draft_calls += self.drafter.engine_calls - calls
            prop = prop.limited(max_nodes, depth)
            if self.chains_only:
                prop = prop.first_path()
            tree = prop.tree()
            window = np.asarray([self.tokens[-1], *prop.tokens], np.int64)
        return Pass(window, len(self.tokens) - 1, tree, np.arange(tree.size), prop, depth, t.elapsed, capped)

    def commit(self, p: Pass, logits: np.ndarray, outs: dict, verify_seconds: float = 0.0) -> list[int]:
        """3. accept and 4. commit, after the verify pass over `p` (`logits` [T, V] of its window rows,
        `outs` its batch-1 outputs); the tokens committed."""
        self.stats.stage_seconds["verify"] += verify_seconds
        with Timer(self.stats, "accept", self.clock):
            logits = biased(logits, self.logit_bias)
            path, nxt = self._accept(p, logits)
        with Timer(self.stats, "commit", self.clock):
            self._commit_kv(p.past, path, outs)
            self._record(p, len(path), verify_seconds)
            kept = len(self.out)
            self.finish = self._emit([*p.window[path].tolist(), nxt])
            if self.top_logprobs is not None:  # token k came from its parent's row (rows copied only then)
                self._read_logprobs(logits[[0, *path]], self.out[kept:])
            self.drafter.observe(self.tokens, self.state)
        return self.out[kept:]

    def _read_logprobs(self, rows: np.ndarray, committed: list[int]) -> None:
        if self.top_logprobs is not None:
            self.logprobs += token_logprobs(rows[: len(committed)], committed, self.top_logprobs)

    def _accept(self, p: Pass, logits: np.ndarray) -> tuple[list[int], int]:
        """3. accept: (accepted window nodes, next token), by this sequence's rule (runtime/acceptance.py).

        greedy (temperature 0): from node n = root, accept the first child c (rank order) whose token is
            argmax p(·|n), set n = c, repeat; stop at a node none of whose children is its argmax. The
            bonus token is argmax p(·|n) at that last accepted node. Each committed token is thus the
            target's argmax given the committed prefix before it — plain greedy's token at that
            position — so by induction over steps the output equals plain greedy decoding bit for bit.
        rejection (temperature > 0): at node n, children c in rank order, each token x_c drawn from q_c:
            accept c with probability min(1, p(x_c)/q_c(x_c)) and move to c (p = c's row); on rejection
            p ← norm(max(0, p − q_c)) and test the next sibling with it. No child accepted: sample the
            next token from the p left (a leaf's p is its target row: the bonus token comes from p).
            For one child, P(y) = min(p, q)(y) + (1 − Σ min(p, q))·norm(max(0, p − q))(y) = p(y): each
            committed token follows the target's distribution. Deterministic drafters (n-gram, greedy
            drafts) give no q: the rule uses one-hot q, i.e. accept x with probability p(x).
        typical (lossy, opt-in): Medusa's entropy-scaled threshold; output no longer follows p.
        """
        q = p.proposal.q
        if q is not None:  # the rule's q has a row per window node; the root's (row 0) is not drafted
            q = np.concatenate([np.zeros_like(q[:1]), q])
        return self.rule(Window(p.window, p.tree, q), logits, self.sampling, self.rng)

    def _commit_kv(self, past: int, path: list[int], outs: dict) -> None:
        """4. commit, the target's side: window node i's K/V were written at row past + i; the accepted
        nodes belong at rows past+1 .. past+A (their positions). A chain's path is 1..A: already there.
        A tree's (e.g. [2, 5]) is compacted: `compact(past + 1, [past + 2, past + 5])` moves those rows
        to the front of the new region. Rows past+A+1.. (rejected nodes) are rolled back by moving
        past_len alone: the next pass starts at past+A+1 (its root: the bonus token) and overwrites them,
        and a pass's attention reads only the rows below its past_len and its own window."""
        rows = [past + n for n in path]
        if rows != list(range(past + 1, past + 1 + len(path))):
            self.compact(past + 1, rows)
        if self.needs_hidden:  # the root's and the accepted nodes' target states, for the drafter
            self.state.write(np.arange(past, past + 1 + len(path)), outs, [0, *path])

    def _record(self, p: Pass, accepted: int, verify_seconds: float) -> None:
        """Per-step statistics; the adaptive controller learns what this depth bought and cost."""
        self.stats.record(len(p.proposal), accepted)
        if self.control and not p.capped:
            self.stats.record_depth(p.depth)
            self.control.update(p.depth, p.tree.depth[1:], accepted, p.propose_seconds, verify_seconds)

    # ── end ─────────────────────────────────────────────────────────────────────────────────
    def cancel(self, reason: str = "cancelled") -> None:
        self.finish = self.finish or reason

    def result(self) -> Result:
        self.stats.new_tokens = len(self.out)
        self.stats.seconds = self.clock() - self.t0
        lossy = self.rule_name in LOSSY
        return Result(token_ids=self.out, finish_reason=self.finish or "length", stats=self.stats,
                      lossy=lossy, lossless=self.exact and not lossy, drafter=getattr(self.drafter, "name", ""))

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
