"""A vanilla draft model: a smaller LM with the target's tokenizer and its own KV cache.

Proposing a tree of the configured shape, level by level:

    root pass   feed the tokens the draft has not seen yet (cache rows stay valid)  → dist at root
    level d     children of each depth-(d-1) node: its top-r tokens (greedy, one-hot q) or i.i.d.
                draws from its warped distribution (sampling, q recorded)
                then one pass over every node of depth ≤ d with the tree mask         → dists at depth d

Tree rows are written after the committed prefix and never enter the cache: after the step the
cache keeps the committed prefix, and the next root pass feeds the accepted tokens.
"""

from __future__ import annotations

import numpy as np

from specrt.engines.ort_cpu.runner import OrtDecoder
from specrt.errors import SpecrtError
from specrt.runtime.drafters import Drafter, DrafterContext, Proposal
from specrt.runtime.drafters.features import common_prefix, layer_backend
from specrt.runtime.drafters.static_tree import expand_static
from specrt.runtime.sampling import SamplingParams, top_desc, warp


class DraftModel(Drafter):
    name = "draft"

    def __init__(self, ctx: DrafterContext):
        graphs = ctx.manifest.graphs
        if "draft" not in graphs:
            raise SpecrtError(f"bundle {ctx.bundle} has no draft model: export it with --draft-layers N or --draft-model PATH")
        entry, target = graphs["draft"], graphs["target"]
        if entry.config.vocab_size != target.config.vocab_size:
            raise SpecrtError(f"draft vocab {entry.config.vocab_size} != target vocab {target.config.vocab_size}: "
                              "the drafter must share the target's tokenizer")
        self.shape = ctx.tree
        path, capacity = ctx.manifest.onnx_path(ctx.bundle, "draft"), ctx.capacity + ctx.tree.size
        # an int4 draft model runs on the target's kernels when the target runs natively (`drafter_layers`)
        self.backend, self.record = layer_backend(path, entry.config, ctx.backend, graph="decoder")
        if self.backend == "native":
            from specrt.engines.native.runner import NativeDecoder

            self.model = NativeDecoder(path, entry.config, capacity, ctx.threads)
        else:
            self.model = OrtDecoder(path, entry.config, capacity, ctx.threads, spin=False)
        self.cached: list[int] = []  # tokens whose K/V rows are valid in the draft cache

    def _run(self, ids: list[int], positions: np.ndarray, past: int, mask: np.ndarray, rows: list[int]) -> np.ndarray:
        self.calls += 1
        logits, _ = self.model.run(np.asarray([ids], np.int64), positions[None], np.array([past], np.int64),
                                   mask[None], np.asarray([rows], np.int64))
        return logits[0]

    def propose(self, tokens, max_nodes, max_depth, sampling: SamplingParams, rng) -> Proposal:
        shape = self.shape
        keep = shape.kept(max_nodes, max_depth)
        if not keep:
            return Proposal()
        new = tokens[len(self.cached):]
        past = len(self.cached)
        t = len(new)
        dist = {0: self._run(new, np.arange(past, past + t), past, np.tril(np.ones((t, t), bool)), [t - 1])[0]}
        self.cached.extend(new)
        base = len(tokens)  # node i's row: base + i - 1; its position: base - 1 + depth

        def evaluate(level: list[int], drafted: dict[int, int]) -> None:
            """One pass over every kept node of depth <= level's: the logits of `level`."""
            upto = [i for i in keep if shape.depth[i] <= shape.depth[level[0]]]
            logits = self._run([drafted[i] for i in upto], base - 1 + shape.depth[upto], base,
                               shape.mask[np.ix_(upto, upto)], [upto.index(i) for i in level])
            dist.update(zip(level, logits, strict=True))

        return expand_static(shape, keep, sampling, rng, ranked=lambda p, n: top_desc(dist[p], n),
                             dist=lambda p: warp(dist[p], sampling), evaluate=evaluate)

    calls = 0  # draft-model passes

    @property
    def engine_calls(self) -> int:
        return self.calls

    def observe(self, tokens: list[int], state=None) -> None:
        # keep the common prefix, but never the newest token: its pass gives the root distribution
        del self.cached[min(common_prefix(self.cached, tokens), len(tokens) - 1):]
