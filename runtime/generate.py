"""The speculative step loop: propose → verify → accept → commit, each stage timed.

    propose  the drafter drafts a tree after the last committed token x (a chain is one path)
    verify   one target pass over [x, drafts...] with the tree mask: logits at every node
    accept   an acceptance rule walks the tree: greedy (argmax) or rejection sampling (lossless),
             or typical acceptance (lossy, opt-in); it returns the accepted nodes and the next token
    commit   append them; move the accepted nodes' KV rows next to the prefix (trees only) and roll
             back the rest by moving past_len; tell the drafter what was committed

Greedy: every committed token is the target's argmax given the committed prefix, so the output
equals plain greedy decoding ("plain" proposes nothing: one token per pass). Sampling: rejection
sampling makes every committed token a draw from the target's (warped) distribution.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError
from specrt.plugins.rejection_sample import sample_from
from specrt.runtime.acceptance import LOSSY, Window, acceptance_for
from specrt.runtime.adaptive import AdaptiveDepth
from specrt.runtime.backend_ort import OrtDecoder
from specrt.runtime.drafters import DrafterContext, Proposal, make_drafter
from specrt.runtime.drafters.features import TargetState
from specrt.runtime.manifest import Manifest
from specrt.runtime.sampling import SamplingParams, warp
from specrt.runtime.tokenizer import Tokenizer
from specrt.runtime.tree import Tree, resolve_tree

STAGES = ("prefill", "propose", "verify", "accept", "commit")


@dataclass
class Stats:
    new_tokens: int = 0
    seconds: float = 0.0
    steps: int = 0  # target passes after prefill
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # by depth in the tree
    plain_steps: int = 0  # adaptive depth chose plain decoding (speculation did not pay)
    depth_sum: int = 0  # draft depth limits chosen, summed over steps (adaptive)
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
        """Accepted drafted tokens over drafted tokens (tree nodes count as drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_draft_depth(self) -> float:
        return self.depth_sum / self.steps if self.steps else 0.0

    def record(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.accepted_per_position.extend([0] * (accepted - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def to_dict(self) -> dict:
        return {"new_tokens": self.new_tokens, "seconds": round(self.seconds, 4),
                "tokens_per_s": round(self.tokens_per_s, 2), "steps": self.steps,
                "mean_accepted_len": round(self.mean_accepted_len, 4),
                "acceptance_rate": round(self.acceptance_rate, 4), "drafted": self.drafted,
                "accepted": self.accepted, "accepted_per_position": self.accepted_per_position,
                "plain_steps": self.plain_steps, "mean_draft_depth": round(self.mean_draft_depth, 3),
                "stage_seconds": {k: round(v, 4) for k, v in self.stage_seconds.items()}}


@dataclass
class Result:
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS) or "length" (max_new_tokens or KV capacity)
    stats: Stats
    text: str = ""
    lossy: bool = False  # True when a lossy acceptance rule (typical) produced it


class _Timer:
    def __init__(self, stats: Stats, stage: str):
        self.stats, self.stage = stats, stage

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.elapsed = time.perf_counter() - self.t0
        self.stats.stage_seconds[self.stage] += self.elapsed


class Generator:
    """Speculative generation with a named drafter over a bundle's target graph (ONNX Runtime, CPU)."""

    def __init__(self, bundle: str | Path, drafter: str = "plain", max_seq_len: int | None = None,
                 threads: int = 2, num_draft_tokens: int = 5, tree: str | None = None,
                 acceptance: str | None = None, adaptive: bool = False, **drafter_options):
        self.bundle = Path(bundle)
        self.manifest = Manifest.load(self.bundle)
        cfg = self.manifest.target.config
        self.capacity = int(max_seq_len or min(2048, cfg.max_position_embeddings))
        if self.capacity < 2:
            raise SpecrtError(f"--max-seq-len {self.capacity} is too small: it must be at least 2")
        self.acceptance = acceptance
        self.eos = set(cfg.eos_token_ids)
        self.tokenizer = Tokenizer(self.bundle, self.manifest.tokenizer)
        self.target = OrtDecoder(self.manifest.onnx_path(self.bundle, "target"), cfg, self.capacity, threads)
        self.threads = threads
        aux = [o for o in self.target.session.get_outputs() if o.name == "aux_hidden_states"]
        self.state = TargetState.allocate(self.capacity + 1, cfg.hidden_size, aux[0].shape[-1] if aux else None)
        self.configure(num_draft_tokens, tree, adaptive, **drafter_options)
        self.use(drafter)

    def configure(self, num_draft_tokens: int = 5, tree: str | None = None, adaptive: bool = False,
                  **drafter_options) -> Generator:
        """Set the speculation settings every drafter shares (drafters are rebuilt on next use); the
        target session and its KV buffers stay."""
        self.k = int(num_draft_tokens)
        self.tree = resolve_tree(tree, self.k)
        self.tree_given = tree is not None
        self.adaptive = adaptive  # choose the draft depth each step (runtime/adaptive.py)
        self.drafter_options = drafter_options
        self._drafters: dict = {}
        self._controls: dict = {}
        if hasattr(self, "drafter_name"):
            self.use(self.drafter_name)
        return self

    def use(self, drafter: str, tree: str | None = None, adaptive: bool | None = None) -> Generator:
        """Switch drafter (and its tree shape; default: the generator's; adaptive depth: default the
        generator's setting). Each (drafter, tree) is built once and reused; the target and its KV
        buffers are shared."""
        self.adaptive_now = self.adaptive if adaptive is None else adaptive
        key = (drafter, tree)
        if key not in self._drafters:
            shape = self.tree if tree is None else resolve_tree(tree, self.k)
            stored = self.manifest.drafter_tree(drafter)
            if tree is None and not self.tree_given and stored:  # the tree exported with the drafter
                shape = Tree.from_paths(stored)
            ctx = DrafterContext(self.bundle, self.manifest, self.capacity, self.threads, shape,
                                 dict(self.drafter_options))
            self._drafters[key] = (make_drafter(drafter, ctx), shape)
        self.drafter_name, (self.drafter, self.drafter_tree) = drafter, self._drafters[key]
        return self

    def _controller(self) -> AdaptiveDepth:
        """The adaptive-depth controller of the current drafter, kept across generations: the costs it
        measured carry over, its acceptance counts carry over at half weight."""
        key = (self.drafter_name, id(self.drafter))
        if key not in self._controls:
            self._controls[key] = AdaptiveDepth(self.max_depth)
        return self._controls[key].begin()

    @property
    def max_depth(self) -> int:
        """The deepest draft the current drafter's tree allows (adaptive depth picks 0..this)."""
        return max(self.k, int(self.drafter_tree.depth.max()) if self.drafter_tree.size > 1 else 1)

    # ── the loop ────────────────────────────────────────────────────────────────────────────
    def stream(self, prompt_ids: list[int], max_new_tokens: int = 128,
               sampling: SamplingParams | None = None) -> Iterator[list[int]]:
        """Yield committed tokens chunk by chunk; the final `Result` is the generator's return value."""
        sampling = sampling or SamplingParams()
        rule_name, rule = acceptance_for(self.acceptance, sampling)
        rng = np.random.default_rng(sampling.seed)
        if not prompt_ids:
            raise SpecrtError("the prompt is empty: give at least one token")
        if len(prompt_ids) >= self.capacity:
            raise SpecrtError(f"the prompt has {len(prompt_ids)} tokens but the KV capacity is {self.capacity}: "
                              "shorten the prompt or raise --max-seq-len")
        stats = Stats()
        t0 = time.perf_counter()
        tokens = list(prompt_ids)
        needs_hidden = getattr(self.drafter, "needs_hidden", False)
        control = self._controller() if self.adaptive_now and self.drafter_name != "plain" else None
        with _Timer(stats, "prefill"):
            first = self._pick(self.forward(tokens, 0, rows=[len(tokens) - 1])[0], sampling, rng)
            if needs_hidden:
                self.state.write(np.arange(len(tokens)), self._outs, np.arange(len(tokens)))
        out: list[int] = []
        finish = self._emit([first], out, tokens, max_new_tokens)
        self.drafter.observe(tokens, self.state)
        yield [first]
        while finish is None:
            if len(tokens) > self.capacity:  # no row left for the next pass
                finish = "length"
                break
            past = len(tokens) - 1
            max_nodes = self.capacity - len(tokens)  # KV rows left after the root's
            max_depth = max_new_tokens - len(out) - 1  # the bonus token needs one more
            depth = min(control.choose().depth, max_depth) if control else max_depth
            with _Timer(stats, "propose") as t_propose:
                prop = Proposal()
                if depth > 0:  # depth 0: adaptive chose a plain step
                    prop = self.drafter.propose(tokens, max_nodes, depth, sampling, rng)
                prop = prop.limited(max_nodes, depth)
                tree = prop.tree()
                window = np.asarray([tokens[-1], *prop.tokens], np.int64)
            with _Timer(stats, "verify") as t_verify:
                logits = self.forward(window, past, tree)
            with _Timer(stats, "accept"):
                q = None if prop.q is None else np.concatenate([np.zeros_like(prop.q[:1]), prop.q])
                path, nxt = rule(Window(window, tree, q), logits, sampling, rng)
                new = [*window[path].tolist(), nxt]
            with _Timer(stats, "commit"):
                rows = [past + n for n in path]
                if rows != list(range(past + 1, past + 1 + len(path))):
                    self.target.compact(past + 1, rows)
                if needs_hidden:  # the root's and the accepted nodes' target states
                    self.state.write(np.arange(past, past + 1 + len(path)), self._outs, [0, *path])
                stats.record(len(prop), len(path))
                if control:
                    stats.depth_sum += depth
                    stats.plain_steps += depth == 0
                    control.update(depth, tree.depth[1:], len(path), t_propose.elapsed, t_verify.elapsed)
                kept = len(out)
                finish = self._emit(new, out, tokens, max_new_tokens)
                self.drafter.observe(tokens, self.state)
            yield out[kept:]
        stats.new_tokens = len(out)
        stats.seconds = time.perf_counter() - t0
        return Result(token_ids=out, finish_reason=finish, stats=stats, lossy=rule_name in LOSSY)

    def forward(self, window, past: int, tree: Tree | None = None, rows=None) -> np.ndarray:
        """One target pass over `window` (a chain unless `tree`) written at KV rows past..;
        returns logits [R, V] for window `rows` (default: all)."""
        tree = tree or Tree.chain(len(window) - 1)
        rows = np.arange(tree.size) if rows is None else rows
        self._outs = self.target.run_all(np.asarray([window], np.int64), (past + tree.depth)[None],
                                         np.array([past], np.int64), tree.mask[None], np.asarray([rows], np.int64))
        return self._outs["logits"][0]

    @staticmethod
    def _pick(logits: np.ndarray, sampling: SamplingParams, rng: np.random.Generator) -> int:
        if sampling.greedy:
            return int(logits.argmax())
        return sample_from(warp(logits, sampling), float(rng.random(dtype=np.float32)))

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
