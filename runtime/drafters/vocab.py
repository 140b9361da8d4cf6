"""A drafter head's draft vocabulary: the target ids its logits cover.

A learned head may compute only the most frequent target tokens (EAGLE-3 and the block drafter always,
EAGLE / MTP / Medusa where they were trained with one): logit i is target id `ids[i]`, stored as the
manifest entry's `vocab_ids` (ROLE/vocab_ids.npy). Drafts and draft distributions leave the drafter as
target ids over the target's vocabulary, so verification and rejection sampling never see draft ids;
the target decides every token, so a smaller head changes what is proposed, never what is output.
"""

from __future__ import annotations

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime.sampling import SamplingParams, top_desc, warp


class DraftVocab:
    """`ids` (draft id -> target id) over a target of `vocab_size` words; None: the whole vocabulary."""

    def __init__(self, ids: np.ndarray | None, vocab_size: int):
        self.ids, self.vocab_size = ids, vocab_size

    @classmethod
    def of(cls, ctx, entry: dict) -> DraftVocab:
        """The vocabulary of manifest drafter `entry` in the bundle of `ctx` (a DrafterContext)."""
        vocab_size = ctx.manifest.target.config.vocab_size
        if "vocab_ids" not in entry:
            return cls(None, vocab_size)
        path = ctx.bundle / entry["vocab_ids"]
        ids = np.load(path, allow_pickle=False)
        if ids.ndim != 1 or not len(ids) or ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= vocab_size:
            raise SpecrtError(f"{path} must list target ids 0..{vocab_size - 1}: export the bundle again")
        return cls(ids.astype(np.int64), vocab_size)

    def __len__(self) -> int:
        return self.vocab_size if self.ids is None else len(self.ids)

    def to_target(self, draft_ids):
        """Draft ids (an array or one id) as target ids."""
        return draft_ids if self.ids is None else self.ids[draft_ids]

    def top(self, logits: np.ndarray, n: int) -> np.ndarray:
        """The target ids of the `n` largest logits, best first."""
        return self.to_target(top_desc(logits, n))

    def dist(self, logits: np.ndarray, sampling: SamplingParams) -> np.ndarray:
        """The warped draft distribution over the target's vocabulary (zero outside the draft vocabulary)."""
        q = warp(logits, sampling)
        if self.ids is None:
            return q
        full = np.zeros(self.vocab_size, np.float32)
        full[self.ids] = q
        return full
