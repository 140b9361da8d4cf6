"""Speculative generation over a bundle: the target with its KV cache, the drafters, the loop.

`Generator.stream` drives one `Sequence` with batch-1 target passes (`run_pass`):

    seq.prefill(run_pass)                           the prompt; the first token
    while (new := seq.step(run_pass)) is not None:  propose → verify → accept → commit, each timed
        yield new

The step itself, with its maths (greedy walk, rejection sampling, KV compaction and rollback), is
on one page in runtime/sequence.py. Greedy output equals plain greedy decoding ("plain" proposes
nothing: one token per pass); sampled output follows the target's (warped) distribution.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from specrt.engines.registry import backend_entry, open_decoder
from specrt.errors import SpecrtError
from specrt.runtime.adaptive import AdaptiveDepth
from specrt.runtime.drafters import DrafterContext, make_drafter
from specrt.runtime.drafters.features import TargetState
from specrt.runtime.exactness import Exactness, resolve
from specrt.runtime.exec_modes import shaped
from specrt.runtime.payoff import AUTO, PLAIN, DrafterChoice, Pick, payoff
from specrt.runtime.reference import Reference
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.sequence import Pass, Sequence, pack_windows
from specrt.runtime.stats import STAGES, Result, Stats  # noqa: F401  (re-exported: the public API)
from specrt.runtime.text import TextAssembler
from specrt.runtime.tokenizer import Tokenizer
from specrt.runtime.tree import Tree, resolve_tree
from specrt.schema.integrity import verify_bundle
from specrt.schema.manifest import Manifest

WINDOW_MARGIN = 66  # KV rows beyond capacity for padded batched windows: root + up to 64 nodes (+1 spare)


def kv_capacity(max_seq_len: int | None, cfg) -> int:
    """KV rows per sequence: `max_seq_len`, default min(2048, the model's maximum), never past the positions
    the model was trained for (max_position_embeddings)."""
    if max_seq_len is None:
        return min(2048, cfg.max_position_embeddings)
    if int(max_seq_len) < 2:
        raise SpecrtError(f"--max-seq-len {max_seq_len} is too small: it must be at least 2")
    if int(max_seq_len) > cfg.max_position_embeddings:
        raise SpecrtError(f"--max-seq-len {max_seq_len} exceeds the model's max_position_embeddings "
                          f"{cfg.max_position_embeddings} (manifest.json): use --max-seq-len "
                          f"{cfg.max_position_embeddings} or less")
    return int(max_seq_len)


class Generator:
    """Speculative generation with a named drafter, or `auto` (each request the drafter whose measured
    pay-off is highest: runtime/payoff.py), over a bundle's target graph (ONNX Runtime, CPU)."""

    def __init__(self, bundle: str | Path, drafter: str = "plain", max_seq_len: int | None = None,
                 threads: int = 2, num_draft_tokens: int = 5, tree: str | None = None,
                 acceptance: str | None = None, adaptive: bool = False, slots: int = 1, backend: str = "ort",
                 exec_mode: str = "auto", allow_inexact: bool = False, verify: bool = False,
                 auto_candidates: Iterable[str] | None = None, **drafter_options):
        """`drafter` "auto": each request runs the candidate drafter (`auto_candidates`, default every
        drafter the bundle has) whose measured pay-off is highest, with adaptive depth, or plain decoding.

        `slots` > 1: the target's KV cache holds that many sequences (the serving scheduler batches
        them); `stream` and `generate` use slot 0.

        `exec_mode`: how target passes are shaped (runtime/exec_modes.py); auto: the cheapest mode
        measured batch-invariant on this machine (runtime/exactness.py). Where none is, speculation
        and batching fall back to plain batch-1 decoding (the exact path) with a note in `notes`,
        unless `allow_inexact`. `verify`: hash every file against manifest.json again, not only the ones
        changed since they were last verified on this machine (schema/integrity.py)."""
        self.bundle = Path(bundle)
        self.manifest = Manifest.load(self.bundle)
        verify_bundle(self.bundle, self.manifest, full=verify)
        cfg = self.manifest.target.config
        self.capacity = kv_capacity(max_seq_len, cfg)
        self.acceptance = acceptance
        self.eos = set(cfg.eos_token_ids)
        self.tokenizer = Tokenizer(self.bundle, self.manifest.tokenizer)
        self.notes: list[str] = []  # one-line notices for the user (the CLI prints them)
        self.exactness: Exactness = resolve(self.bundle, self.manifest, threads, backend, exec_mode, self.capacity,
                                            batched=int(slots) > 1)
        self.allow_inexact = allow_inexact
        self.slots = int(slots)
        if self.slots > 1 and not (self.exactness.plain_batches or allow_inexact):
            self.note(f"note: batching {self.slots} sequences per pass is not exact here "
                      f"({self.exactness.reason}); serving one sequence at a time. --allow-inexact batches anyway.")
            self.slots = 1
        # padded passes (batched windows, execution modes) write KV rows past the window: room for them
        mode = self.exactness.mode
        rows = self.capacity + (WINDOW_MARGIN if self.slots > 1 else mode.min_rows - 1)
        if backend_entry(backend).pinned_capacity:  # engines built for `capacity` rows: the margin comes off it
            rows, self.capacity = self.capacity, self.capacity - (mode.min_rows - 1)
        self.backend = backend  # the target's (engines/registry.py); drafters run on ONNX Runtime, CPU
        target = open_decoder(backend, self.bundle, self.manifest, "target", rows, threads, self.slots)
        self.target = shaped(target, mode)
        self.threads = threads
        self.state = self.new_state()
        self.auto_candidates = self.candidates(auto_candidates)
        self._set_speculation(num_draft_tokens, tree, adaptive, drafter_options)  # then a drafter to use
        self.use(drafter)

    def configure(self, num_draft_tokens: int = 5, tree: str | None = None, adaptive: bool = False,
                  **drafter_options) -> Generator:
        """Change the speculation settings every drafter shares: the current drafter is rebuilt with them
        now, the others on their next use; the target session and its KV buffers stay."""
        name = AUTO if self.choice is not None else self.drafter_name
        self._set_speculation(num_draft_tokens, tree, adaptive, drafter_options)
        return self.use(name)

    def _set_speculation(self, num_draft_tokens: int, tree: str | None, adaptive: bool, drafter_options: dict) -> None:
        """The settings every drafter shares; forgets the drafters and controllers built with other ones."""
        self.k = int(num_draft_tokens)
        self.tree = resolve_tree(tree, self.k)
        self.tree_given = tree is not None
        self.adaptive = adaptive  # choose the draft depth each step (runtime/adaptive.py)
        self.drafter_options = drafter_options
        self._drafters: dict = {}  # (drafter, tree, scope) -> (instance, tree shape)
        self._controls: dict = {}  # … -> its adaptive controller
        self.scope: str | None = None  # whose drafter instances `use` picks (see `use`)
        self.choice: DrafterChoice | None = None  # set while `auto` is in use: the per-request choice
        self.auto_tree: str | None = None  # the tree shape auto's drafters use
        self._choices: dict = {}  # (tree, serving) -> DrafterChoice, kept while these settings hold
        self._served: dict = {}  # auto in the serving scheduler: (slot, drafter) -> that slot's instance
        self._served_controls: dict = {}  # … drafter -> its adaptive controller, shared by the slots
        self.last_pick: Pick | None = None

    def new_state(self) -> TargetState:
        """Room for one sequence's target hidden states (learned drafters read them), with the tapped
        layers' too when the target graph outputs them (EAGLE-3: aux_hidden_states [B, T, n·H])."""
        cfg = self.manifest.target.config
        aux = self.target.output_width("aux_hidden_states")  # the Decoder protocol: any backend
        return TargetState.allocate(self.capacity + 1, cfg.hidden_size, aux)

    def new_drafter(self, drafter: str, tree: str | None = None):
        """A fresh drafter instance (its own caches) with this generator's settings; (drafter, tree shape)."""
        shape = self.tree if tree is None else resolve_tree(tree, self.k)
        stored = self.manifest.drafter_tree(drafter)
        if tree is None and not self.tree_given and stored:  # the tree exported with the drafter
            shape = Tree.from_paths(stored)
        ctx = DrafterContext(self.bundle, self.manifest, self.capacity, self.threads, shape, dict(self.drafter_options))
        return make_drafter(drafter, ctx), shape

    def use(self, drafter: str, tree: str | None = None, adaptive: bool | None = None,
            scope: str | None = None) -> Generator:
        """Switch drafter (and its tree shape; default: the generator's; adaptive depth: default the
        generator's setting). Each (drafter, tree) is built once and reused; the target and its KV
        buffers are shared. "auto": every request chooses among `auto_candidates` (with `tree`), always with
        adaptive depth; what it measured is kept for the next time auto is used. `scope`: a name whose
        drafters and controllers are its own (a benchmark gives each engine one, so that one engine's
        memory of earlier sequences, suffix's store, never drafts for another)."""
        self.adaptive_now = self.adaptive if adaptive is None else adaptive
        self.scope = scope
        self.requested_drafter = drafter
        if drafter != "plain" and not self.exact_batches:
            self.note(f"note: speculative decoding ({drafter}) is not exact here ({self.exactness.reason}); "
                      "running plain decoding. --allow-inexact speculates anyway.")
            drafter, tree = "plain", None
        self.choice = None
        if drafter == AUTO:
            self.adaptive_now, self.auto_tree = True, tree
            self.choice = self._choice(tree, serving=False)
            drafter = PLAIN  # until a request chooses
        return self._switch(drafter, tree)

    def _switch(self, drafter: str, tree: str | None) -> Generator:
        """Make (drafter, tree) the current drafter, built on first use."""
        key = (drafter, tree, self.scope)
        if key not in self._drafters:
            self._drafters[key] = self.new_drafter(drafter, tree)
        self.drafter_name, (self.drafter, self.drafter_tree) = drafter, self._drafters[key]
        self._drafter_key = key
        return self

    def fresh_drafter(self):
        """Another instance of the current drafter, configured exactly like it (name, tree, options) but
        with its own caches: the serving scheduler gives one to each further KV slot."""
        return self.new_drafter(*self._drafter_key[:2])[0]

    def forget(self) -> None:
        """Every drafter built so far drops its memory of earlier sequences (suffix's store)."""
        for inst, _ in self._drafters.values():
            inst.forget()

    def _controller(self) -> AdaptiveDepth:
        """The adaptive-depth controller of the current drafter, kept across generations: the costs it
        measured carry over, its acceptance counts carry over at half weight."""
        if self._drafter_key not in self._controls:
            self._controls[self._drafter_key] = AdaptiveDepth(self.max_depth)
        return self._controls[self._drafter_key].begin()

    # ── auto: the drafter of each request by measured pay-off (runtime/payoff.py) ───────────────────
    def candidates(self, names: Iterable[str] | None = None) -> list[str]:
        """The drafters `auto` chooses among: `names` (checked against the bundle), default every runtime
        drafter whose kind the bundle has; plain decoding is always the fallback."""
        from specrt.kinds import kinds, runtime_drafters

        have = [n for spec in kinds().values() if spec.available_in(self.manifest) for n in spec.runtime]
        if names is None:
            return have
        names = [n.strip() for n in names if n.strip()]
        table = runtime_drafters()
        for n in names:
            if n not in table:
                raise SpecrtError(f"--auto-candidates: unknown drafter {n!r}: choose among {', '.join(have)}")
            if n not in have:
                raise SpecrtError(f"--auto-candidates: drafter {n!r} is not in bundle {self.bundle} (manifest.json): "
                                  f"export it with --drafter {table[n].name}, or choose among {', '.join(have)}")
        return names

    def _choice(self, tree: str | None, serving: bool) -> DrafterChoice:
        """auto's choice for drafters of shape `tree`; batch-1 generation and the serving scheduler (whose
        passes are batched: other costs) each keep their own."""
        key = (tree, serving)
        if key not in self._choices:
            self._choices[key] = DrafterChoice(self.auto_candidates)
        return self._choices[key]

    def _choose(self) -> None:
        """auto, at the start of a request: switch to the drafter the measured pay-offs pick."""
        tree = self.auto_tree
        pays = {d: payoff(self._controls.get((d, tree, self.scope))) for d in self.choice.candidates}
        self.last_pick = self.choice.choose(pays)
        self._switch(self.last_pick.drafter, tree)

    def served_drafter(self, slot: int) -> tuple:
        """auto in the serving scheduler: (drafter, adaptive controller or None: plain) for the request KV
        slot `slot` admits now. The choice and one controller per drafter are shared by the slots (they measure
        the batched passes the server runs); each slot has its own drafter instances (caches), slot 0 the
        generator's own, as `generate` uses them."""
        choice, tree = self._choice(self.auto_tree, serving=True), self.auto_tree
        name = choice.choose({d: payoff(self._served_controls.get(d)) for d in choice.candidates}).drafter
        key = (name, tree, None)
        if key not in self._drafters:
            self._drafters[key] = self.new_drafter(name, tree)
        own, shape = self._drafters[key]
        if (slot, name) not in self._served:
            inst = own if slot == 0 else self.new_drafter(name, tree)[0]
            inst.share(own)  # one server-wide memory of earlier sequences (suffix's store)
            self._served[(slot, name)] = inst
        if name == PLAIN:
            return self._served[(slot, name)], None
        if name not in self._served_controls:
            self._served_controls[name] = AdaptiveDepth(self._depth_of(shape))
        return self._served[(slot, name)], self._served_controls[name]  # the scheduler begins it

    @property
    def drafter_label(self) -> str:
        """What a server reports it runs: the drafter, or "auto"."""
        return AUTO if self.choice is not None else self.drafter_name

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    @property
    def batches_exact(self) -> bool:
        """Does this generator's batching (if it batches) keep every row plain decoding's?"""
        return self.slots == 1 or self.exactness.plain_batches

    @property
    def exact_batches(self) -> bool:
        """May passes carry drafts (at batch 1, and in batched passes where this generator batches)?"""
        return (self.exactness.lossless and self.batches_exact) or self.allow_inexact

    @property
    def lossless(self) -> bool:
        """Does what this generator commits equal plain batch-1 decoding of its target (greedy), or
        follow its distribution (sampling)? (A lossy acceptance rule is reported per result.)"""
        return self.batches_exact and (self.exactness.lossless or self.drafter_name == "plain")

    @property
    def reference(self) -> Reference:
        """What this generator's output is exact to where `lossless` holds: plain decoding of its target
        graph on its backend in its execution mode (runtime/reference.py)."""
        return Reference.of(self)

    @property
    def max_depth(self) -> int:
        """The deepest draft the current drafter's tree allows (adaptive depth picks 0..this)."""
        return self._depth_of(self.drafter_tree)

    def _depth_of(self, tree: Tree) -> int:
        return max(self.k, int(tree.depth.max()) if tree.size > 1 else 1)

    # ── the loop ────────────────────────────────────────────────────────────────────────────
    def sequence(self, prompt_ids: list[int], max_new_tokens: int = 128, sampling: SamplingParams | None = None,
                 slot: int = 0, drafter=None, state: TargetState | None = None, control: AdaptiveDepth | None = None,
                 max_nodes: int | None = None, **options) -> Sequence:
        """A new generation in KV slot `slot` of this generator's target. Default: slot 0 with the
        generator's own drafter, target state and adaptive controller; the serving scheduler passes each
        slot's own. `options`: `logit_bias`, `logprobs` (runtime/logits.py)."""
        if drafter is None:
            if self.choice is not None:
                self._choose()
            drafter, state = self.drafter, self.state
            control = self._controller() if self.adaptive_now and self.drafter_name != "plain" else None
        return Sequence(prompt_ids, max_new_tokens, sampling, self.acceptance, drafter, state, self.capacity,
                        self.eos, lambda dst, rows: self.target.compact(dst, rows, slot), control, max_nodes,
                        exact=self.lossless, chains_only=not backend_entry(self.backend).trees, **options)

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

    def run_pass(self, p: Pass) -> dict[str, np.ndarray]:
        """One batch-1 target pass over `p` in KV slot 0: every output, batch axis kept (logits
        [1, R, V] for `p.rows`, hidden_states [1, T, H], aux_hidden_states when the graph has them)."""
        self.target.select(0, 1)
        return self.target.run_all(*pack_windows([p]))

    def forward(self, window, past: int, tree: Tree | None = None, rows=None) -> dict[str, np.ndarray]:
        """One target pass over `window` (a chain unless `tree`) written at KV rows past..; every output
        as `run_pass` gives them: `forward(...)["logits"][0]` is logits [R, V] for window `rows`
        (default: all)."""
        tree = tree or Tree.chain(len(window) - 1)
        rows = np.arange(tree.size) if rows is None else np.asarray(rows, np.int64)
        return self.run_pass(Pass(np.asarray(window, np.int64), past, tree, rows))

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
