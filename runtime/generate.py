"""Speculative generation over a bundle: a thin façade over the target, the drafters and the loop.

    TargetModel  runtime/target.py    manifest, integrity, tokenizer, exactness, decoder, KV capacity
    DrafterPool  runtime/pool.py      drafter instances, adaptive controllers, auto's choices, serving slots
    SpecSettings runtime/settings.py  draft tokens, tree, adaptive depth, drafter options (frozen)

`Generator.stream` drives one `Sequence` with batch-1 target passes (`run_pass`):

    seq.prefill(run_pass)                           the prompt; the first token
    while (new := seq.step(run_pass)) is not None:  propose → verify → accept → commit, each timed
        yield new

The step itself, with its maths (greedy walk, rejection sampling, KV compaction and rollback), is
on one page in runtime/sequence.py. Greedy output equals plain greedy decoding ("plain" proposes
nothing: one token per pass); sampled output follows the target's (warped) distribution. The target
runs on any backend of engines/registry.py; drafters on ONNX Runtime, CPU, and EAGLE, EAGLE-3 and MTP layers,
Medusa heads and the draft model on the native kernels where the target runs there (runtime/drafters/features.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime.adaptive import AdaptiveDepth
from specrt.runtime.clock import Clock
from specrt.runtime.costs import CostCurve
from specrt.runtime.drafters import Drafter
from specrt.runtime.drafters.features import TargetState
from specrt.runtime.payoff import AUTO, PLAIN, DrafterChoice, Pick
from specrt.runtime.pool import DrafterPool, Key, candidates
from specrt.runtime.reference import Reference
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.sequence import Pass, Sequence
from specrt.runtime.settings import Request, SpecSettings
from specrt.runtime.stats import STAGES, Result, Stats  # noqa: F401  (re-exported: the public API)
from specrt.runtime.target import TargetModel
from specrt.runtime.text import TextAssembler
from specrt.runtime.tree import Tree


class Generator:
    """Speculative generation with a named drafter, or `auto` (each request the drafter whose measured
    pay-off is highest: runtime/payoff.py), over a bundle's target graph."""

    def __init__(self, bundle: str | Path, drafter: str = "plain", max_seq_len: int | None = None,
                 threads: int = 2, num_draft_tokens: int = 5, tree: str | None = None,
                 acceptance: str | None = None, adaptive: bool = False, slots: int = 1, backend: str = "auto",
                 exec_mode: str = "auto", allow_inexact: bool = False, verify: bool = False,
                 auto_candidates: Iterable[str] | None = None, clock: Clock = time.perf_counter,
                 costs: CostCurve | str | None = "auto", kv_dtype: str = "auto", **drafter_options):
        """`drafter` "auto": each request runs the candidate drafter (`auto_candidates`, default every
        drafter the bundle has) whose measured pay-off is highest, with adaptive depth, or plain decoding.

        `slots` > 1: the target's KV cache holds that many sequences (the serving scheduler batches
        them); `stream` and `generate` use slot 0.

        `exec_mode`: how target passes are shaped (runtime/exec_modes.py); auto: the cheapest mode
        measured batch-invariant on this machine (runtime/exactness.py). Where none is, speculation
        and batching fall back to plain batch-1 decoding (the exact path) with a note in `notes`,
        unless `allow_inexact`. `verify`: hash every file against manifest.json again, not only the ones
        changed since they were last verified on this machine (schema/integrity.py).

        `clock`: what its sequences, and a serving scheduler over it, measure the seconds they decide
        from by (runtime/clock.py; a test's `FakeClock`). `costs`: the verify cost curve that adaptive depth and
        the default dynamic-tree shape price passes by (runtime/costs.py): "auto" measures this machine's
        (cached) where `clock` is the real one; a test's clock scripts every second, so it gets none unless
        it gives a `CostCurve`; None: none (adaptive depth fits a line to the steps).

        `kv_dtype`: the target's KV cache, fp32, fp16 or int8 (native only: each key and value rounded to the
        nearest half, or each block of 32 to int8 codes and a scale, as it is written; plain and speculative
        decoding share that rounding, so they stay bitwise equal); auto: fp16 where the backend holds it, else
        fp32."""
        self.clock = clock
        if costs == "auto":
            costs = "measure" if clock is time.perf_counter else None
        elif costs is not None and not isinstance(costs, CostCurve):
            raise SpecrtError(f"costs {costs!r}: give \"auto\", None or a CostCurve (runtime/costs.py)")
        self._costs = costs
        self.model = TargetModel(bundle, max_seq_len, threads, backend, exec_mode, slots, allow_inexact, verify,
                                 kv_dtype)
        self.acceptance = acceptance
        self.state = self.new_state()  # slot 0's target state (`generate` and the scheduler's slot 0)
        self.auto_candidates = candidates(self.model, auto_candidates)
        self._settle(SpecSettings(num_draft_tokens, tree, adaptive, drafter_options))
        self.use(drafter)

    # ── the target (runtime/target.py) ─────────────────────────────────────────────────────────
    bundle = property(lambda self: self.model.bundle)
    manifest = property(lambda self: self.model.manifest)
    tokenizer = property(lambda self: self.model.tokenizer)
    exactness = property(lambda self: self.model.exactness)
    capacity = property(lambda self: self.model.capacity)
    eos = property(lambda self: self.model.eos)
    slots = property(lambda self: self.model.slots)
    backend = property(lambda self: self.model.backend)  # the target's (engines/registry.py)
    threads = property(lambda self: self.model.threads)
    notes = property(lambda self: self.model.notes)  # one-line notices for the user (the CLI prints them)
    target = property(lambda self: self.model.decoder, doc="The target's decoder (engines/decoder.py).")
    batches_exact = property(lambda self: self.model.batches_exact)
    exact_batches = property(lambda self: self.model.drafts_exact)

    def note(self, text: str) -> None:
        self.model.note(text)

    def cost_curve(self) -> CostCurve | None:
        """The verify cost curve this generator prices draft shapes by (None: none; see `costs`)."""
        return self.model.cost_curve() if self._costs == "measure" else self._costs

    def new_state(self) -> TargetState:
        return self.model.new_state()

    def run_pass(self, p: Pass) -> dict[str, np.ndarray]:
        return self.model.run_pass(p)

    def forward(self, window, past: int, tree: Tree | None = None, rows=None) -> dict[str, np.ndarray]:
        return self.model.forward(window, past, tree, rows)

    @property
    def lossless(self) -> bool:
        """Does what this generator commits equal plain batch-1 decoding of its target (greedy), or
        follow its distribution (sampling)? (A lossy acceptance rule is reported per result.)"""
        return self.model.lossless_with(self.drafter_name)

    @property
    def reference(self) -> Reference:
        """What this generator's output is exact to where `lossless` holds: plain decoding of its target
        graph on its backend in its execution mode (runtime/reference.py)."""
        return Reference.of(self)

    # ── speculation settings and the drafter in use (runtime/settings.py, runtime/pool.py) ─────────
    k = property(lambda self: self.settings.num_draft_tokens)
    tree = property(lambda self: self.settings.shape)
    adaptive = property(lambda self: self.settings.adaptive)

    def configure(self, num_draft_tokens: int = 5, tree: str | None = None, adaptive: bool = False,
                  **drafter_options) -> Generator:
        """Change the speculation settings every drafter shares: the current drafter is rebuilt with them
        now, the others on their next use; the target session and its KV buffers stay."""
        name = AUTO if self.choice is not None else self.drafter_name
        self._settle(SpecSettings(num_draft_tokens, tree, adaptive, drafter_options))
        return self.use(name)

    def _settle(self, settings: SpecSettings) -> None:
        """New settings: a new pool, so no drafter or controller built with other settings is reused."""
        self.settings = settings
        self.pool = DrafterPool(self.model, settings, self.auto_candidates, self.cost_curve)
        self.scope: str | None = None  # whose drafter instances `use` picks (see `use`)
        self.choice: DrafterChoice | None = None  # set while `auto` is in use: the per-request choice
        self.auto_tree: str | None = None  # the tree shape auto's drafters use
        self.last_pick: Pick | None = None

    def use(self, drafter: str, tree: str | None = None, adaptive: bool | None = None,
            scope: str | None = None) -> Generator:
        """Switch drafter (and its tree shape; default: the generator's; adaptive depth: default the
        generator's setting). Each (drafter, tree) is built once and reused; the target and its KV
        buffers are shared. "auto": every request chooses among `auto_candidates` (with `tree`), always with
        adaptive depth; what it measured is kept for the next time auto is used. `scope`: a name whose
        drafters and controllers are its own (a benchmark gives each engine one, so that one engine's
        memory of earlier sequences, suffix's store, never drafts for another)."""
        self.adaptive_now = self.settings.adaptive if adaptive is None else adaptive
        self.scope = scope
        self.requested_drafter = drafter
        if drafter != PLAIN and not self.exact_batches:
            self.note(f"note: speculative decoding ({drafter}) is not exact here ({self.exactness.reason}); "
                      "running plain decoding. --allow-inexact speculates anyway.")
            drafter, tree = PLAIN, None
        self.choice = None
        if drafter == AUTO:
            self.adaptive_now, self.auto_tree = True, tree
            self.choice = self.pool.choice(tree, serving=False)
            drafter = PLAIN  # until a request chooses
        return self._switch(Key(drafter, tree, scope))

    def _switch(self, key: Key) -> Generator:
        self.key = key
        self.drafter, self.drafter_tree = self.pool.get(key)
        return self

    drafter_name = property(lambda self: self.key.drafter)

    @property
    def drafter_label(self) -> str:
        """What a server reports it runs: the drafter, or "auto"."""
        return AUTO if self.choice is not None else self.drafter_name

    @property
    def max_depth(self) -> int:
        """The deepest draft the current drafter's tree allows (adaptive depth picks 0..this)."""
        return self.settings.depth_of(self.drafter_tree)

    def fresh_drafter(self) -> Drafter:
        """Another instance of the current drafter, configured exactly like it (name, tree, options) but
        with its own caches: the serving scheduler gives one to each further KV slot."""
        return self.pool.build(self.key.drafter, self.key.tree)[0]

    def new_control(self) -> AdaptiveDepth | None:
        """A fresh adaptive-depth controller for the current drafter where adaptive depth is on (None: a
        fixed depth): the serving scheduler gives one to each KV slot."""
        return AdaptiveDepth(self.max_depth) if self._adapts else None

    @property
    def _adapts(self) -> bool:
        return self.adaptive_now and self.drafter_name != PLAIN

    def served_drafter(self, slot: int) -> tuple[Drafter, AdaptiveDepth | None]:
        """auto in the serving scheduler: (drafter, adaptive controller or None) for KV slot `slot`'s new
        request (DrafterPool.served)."""
        return self.pool.served(slot, self.auto_tree)

    def forget(self) -> None:
        """Every drafter built so far drops its memory of earlier sequences (suffix's store)."""
        self.pool.forget()

    # ── the loop ────────────────────────────────────────────────────────────────────────────
    def sequence(self, prompt_ids: list[int], max_new_tokens: int = 128, sampling: SamplingParams | None = None,
                 slot: int = 0, drafter: Drafter | None = None, state: TargetState | None = None,
                 control: AdaptiveDepth | None = None, max_nodes: int | None = None, **options) -> Sequence:
        """A new generation in KV slot `slot` of this generator's target. Default: slot 0 with the
        generator's own drafter, target state and adaptive controller; the serving scheduler passes each
        slot's own. `options`: `logit_bias`, `logprobs` (runtime/logits.py)."""
        if drafter is None:
            if self.choice is not None:  # auto: this request's drafter
                self.last_pick = self.pool.pick(self.auto_tree, self.scope)
                self._switch(Key(self.last_pick.drafter, self.auto_tree, self.scope))
            drafter, state = self.drafter, self.state
            control = self.pool.controller(self.key) if self._adapts else None
        request = Request(prompt_ids, max_new_tokens, sampling, **options)
        return Sequence(request, self.model.terms(self.acceptance, self.drafter_name), drafter, state,
                        self.model.compactor(slot), control, max_nodes, self.clock)

    def stream(self, prompt_ids: list[int], max_new_tokens: int = 128,
               sampling: SamplingParams | None = None) -> Iterator[list[int]]:
        """Yield committed tokens chunk by chunk; the final `Result` is the generator's return value."""
        seq = self.sequence(prompt_ids, max_new_tokens, sampling)
        yield seq.prefill(self.run_pass)
        while (new := seq.step(self.run_pass)) is not None:
            yield new
        return seq.result()

    def iter_text(self, prompt: str, max_new_tokens: int = 128, raw: bool = False,
                  sampling: SamplingParams | None = None) -> TextStream:
        """Streaming for embedding: iterate to get text pieces as they are committed; afterwards
        `.result` holds the full `Result` (text, token ids, finish reason, stats)."""
        return TextStream(self, self.tokenizer.encode_prompt(prompt, raw), max_new_tokens, sampling)

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int = 128,
                     sampling: SamplingParams | None = None) -> Result:
        it = self.stream(prompt_ids, max_new_tokens, sampling)
        while True:
            try:
                next(it)
            except StopIteration as stop:
                return stop.value

    def generate(self, prompt: str, max_new_tokens: int = 128, raw: bool = False,
                 sampling: SamplingParams | None = None) -> Result:
        result = self.generate_ids(self.tokenizer.encode_prompt(prompt, raw), max_new_tokens, sampling)
        result.text = self.tokenizer.decode(result.token_ids)
        return result


class TextStream:
    """Text pieces of one generation as they are committed (never ending in half a UTF-8 character);
    `.result` is set when the iteration ends."""

    def __init__(self, gen: Generator, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams | None):
        self._tokens = gen.stream(prompt_ids, max_new_tokens, sampling)
        self._text = TextAssembler(gen.tokenizer.decode, None)
        self.result: Result | None = None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        while self.result is None:
            try:
                piece = self._text.feed(next(self._tokens))
            except StopIteration as stop:
                self.result = stop.value
                piece = self._text.flush()
                self.result.text = self._text.decode(self.result.token_ids)
            if piece:
                return piece
        raise StopIteration
