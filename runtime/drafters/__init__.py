"""Drafters propose tokens for the target to verify; one small protocol, registered by name.

    drafter.propose(tokens, k) -> up to k draft tokens that follow `tokens`
    drafter.observe(tokens)    -> the committed sequence after a step (re-sync own state/KV)

A chain is the one-path case of the tree that later drafters propose.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from specrt.errors import SpecrtError


@dataclass
class DrafterContext:
    """What a drafter may need to build itself: the bundle, its manifest and runtime settings."""

    bundle: Path
    manifest: object
    capacity: int
    threads: int
    options: dict


class Drafter(Protocol):
    name: str

    def propose(self, tokens: list[int], k: int) -> list[int]: ...

    def observe(self, tokens: list[int]) -> None: ...


DRAFTERS: dict[str, Callable[[DrafterContext], Drafter]] = {}


def register(name: str):
    def deco(factory):
        DRAFTERS[name] = factory
        return factory

    return deco


def make_drafter(name: str, ctx: DrafterContext) -> Drafter:
    from specrt.runtime.drafters import draft_model, ngram, plain  # noqa: F401  (registration)

    if name not in DRAFTERS:
        raise SpecrtError(f"unknown drafter {name!r}: choose one of {', '.join(sorted(DRAFTERS))}")
    return DRAFTERS[name](ctx)
