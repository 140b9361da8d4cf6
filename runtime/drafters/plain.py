"""No drafter: every step verifies only the last token, i.e. plain greedy decoding."""

from __future__ import annotations

from specrt.runtime.drafters import DrafterContext, register


@register("plain")
class Plain:
    name = "plain"

    def __init__(self, ctx: DrafterContext | None = None):
        pass

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return []

    def observe(self, tokens: list[int]) -> None:
        pass
