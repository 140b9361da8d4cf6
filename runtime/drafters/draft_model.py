"""A vanilla draft model: a smaller LM with the target's tokenizer and its own KV cache.

It drafts greedily, one token per pass. Its cache holds the tokens it has seen; after each step it
keeps the longest prefix that agrees with the committed sequence and rolls the rest back by moving
its length, so the next proposal first feeds only the tokens it has not seen.
"""

from __future__ import annotations

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime.backend_ort import OrtDecoder
from specrt.runtime.drafters import DrafterContext, register


@register("draft")
class DraftModel:
    name = "draft"

    def __init__(self, ctx: DrafterContext):
        graphs = ctx.manifest.graphs
        if "draft" not in graphs:
            raise SpecrtError(f"bundle {ctx.bundle} has no draft model: export it with --draft-layers N or --draft-model PATH")
        entry, target = graphs["draft"], graphs["target"]
        if entry.config.vocab_size != target.config.vocab_size:
            raise SpecrtError(f"draft vocab {entry.config.vocab_size} != target vocab {target.config.vocab_size}: "
                              "the drafter must share the target's tokenizer")
        self.max_k = int(ctx.options.get("max_draft", 16))
        self.model = OrtDecoder(ctx.manifest.onnx_path(ctx.bundle, "draft"), entry.config, ctx.capacity + self.max_k,
                                ctx.threads)
        self.cached: list[int] = []  # tokens whose K/V rows are valid in the draft cache

    def _forward(self, new: list[int]) -> int:
        past, t = len(self.cached), len(new)
        ids = np.asarray([new], np.int64)
        pos = np.arange(past, past + t, dtype=np.int64)[None]
        mask = np.tril(np.ones((t, t), bool))[None]
        logits, _ = self.model.run(ids, pos, np.array([past], np.int64), mask, np.array([[t - 1]], np.int64))
        self.cached.extend(new)
        return int(logits[0, 0].argmax())

    def propose(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        drafts = [self._forward(tokens[len(self.cached):])]
        while len(drafts) < k:
            drafts.append(self._forward(drafts[-1:]))
        return drafts

    def observe(self, tokens: list[int]) -> None:
        n = 0
        limit = min(len(self.cached), len(tokens))
        while n < limit and self.cached[n] == tokens[n]:
            n += 1
        del self.cached[n:]
