"""No drafter: every step verifies only the last token, i.e. plain decoding."""

from __future__ import annotations

from specrt.runtime.drafters import Drafter, DrafterContext, Proposal


class Plain(Drafter):
    name = "plain"

    def __init__(self, ctx: DrafterContext | None = None):
        pass

    def propose(self, tokens, max_nodes, max_depth, sampling, rng) -> Proposal:
        return Proposal()

    def observe(self, tokens: list[int], state=None) -> None:
        pass
