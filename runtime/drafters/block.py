"""The one-pass block drafter: one feature-layer pass over the new committed rows and K-1 mask rows
gives the draft distributions of depths 1..K (export/drafters/block.py). Its cost does not grow
with depth. The tree is static (the stored Medusa-style tree, or the generator's): a node at depth d
takes depth d's r-th candidate, whatever its parent, as Medusa's heads do. With sampling each node
is an i.i.d. draw from depth d's warped distribution, recorded as q, so rejection stays lossless."""

from __future__ import annotations

import numpy as np

from specrt.runtime.drafters import Drafter, DrafterContext, Proposal
from specrt.runtime.drafters.features import FeatureLayer, TargetState
from specrt.runtime.drafters.static_tree import expand_by_depth
from specrt.runtime.drafters.vocab import DraftVocab
from specrt.runtime.sampling import SamplingParams


class BlockDrafter(Drafter):
    name = "block"
    needs_hidden = True

    def __init__(self, ctx: DrafterContext):
        entry = ctx.manifest.drafter("block", ctx.bundle)
        self.block = int(entry["config"]["block_size"])
        self.shape = ctx.tree
        layer, fuse = entry["graphs"]
        cfg = ctx.manifest.graphs[layer].config
        self.layer = FeatureLayer(ctx.manifest.onnx_path(ctx.bundle, layer), cfg, ctx.capacity + self.block, ctx.threads,
                                  ctx.backend, ctx.manifest.onnx_path(ctx.bundle, fuse), ctx.target_embedding)
        self.vocab = DraftVocab.of(ctx, entry)
        self.state: TargetState | None = None

    @property
    def engine_calls(self) -> int:
        return self.layer.calls

    def observe(self, tokens: list[int], state: TargetState | None = None) -> None:
        self.state = state
        self.layer.sync(tokens)

    def taps(self, start: int, end: int) -> np.ndarray:
        return self.state.aux[start:end]

    def propose(self, tokens, max_nodes, max_depth, sampling: SamplingParams, rng) -> Proposal:
        m = len(tokens) - 1
        keep = self.shape.kept(max_nodes, min(max_depth, self.block))
        if m < 1 or not keep:
            return Proposal()
        depth = int(self.shape.depth[keep].max())
        logits = np.atleast_2d(self.layer.catch_up(tokens, None, m, mask_rows=depth - 1, taps=self.taps)[0])  # [depth, V']
        return expand_by_depth(self.shape, keep, logits, self.vocab, sampling, rng)
