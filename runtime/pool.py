"""The drafters of one target: instances built once and reused, their adaptive-depth controllers, auto's
choices, and the serving scheduler's per-slot instances.

Keys: an instance is (drafter, tree, scope) — `scope` gives a benchmark's engine drafters of its own,
so one engine's memory of earlier sequences (suffix's store) never drafts for another. Settings change
(`Generator.configure`): the pool is replaced, its instances and measurements with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from specrt.errors import SpecrtError
from specrt.runtime.adaptive import AdaptiveDepth
from specrt.runtime.costs import CostCurve
from specrt.runtime.drafters import Drafter, DrafterContext, make_drafter
from specrt.runtime.payoff import PLAIN, DrafterChoice, Pick, payoff
from specrt.runtime.settings import SpecSettings
from specrt.runtime.target import TargetModel
from specrt.runtime.tree import Tree


@dataclass(frozen=True)
class Key:
    drafter: str
    tree: str | None = None
    scope: str | None = None


def candidates(model: TargetModel, names: Iterable[str] | None = None) -> list[str]:
    """The drafters `auto` chooses among: `names` (checked against the bundle), default every runtime
    drafter whose kind the bundle has; plain decoding is always the fallback."""
    from specrt.kinds import kinds, runtime_drafters

    have = [n for spec in kinds().values() if spec.available_in(model.manifest) for n in spec.runtime]
    if names is None:
        return have
    names = [n.strip() for n in names if n.strip()]
    table = runtime_drafters()
    for n in names:
        if n not in table:
            raise SpecrtError(f"--auto-candidates: unknown drafter {n!r}: choose among {', '.join(have)}")
        if n not in have:
            raise SpecrtError(f"--auto-candidates: drafter {n!r} is not in bundle {model.bundle} (manifest.json): "
                              f"export it with --drafter {table[n].name}, or choose among {', '.join(have)}")
    return names


class DrafterPool:
    def __init__(self, model: TargetModel, settings: SpecSettings, auto_candidates: list[str],
                 costs: Callable[[], CostCurve | None] = lambda: None):
        """`costs`: the verify cost curve batch-1 controllers price passes by (runtime/costs.py; None: a line
        fitted to the steps)."""
        self.model, self.settings, self.auto_candidates, self.costs = model, settings, auto_candidates, costs
        self._instances: dict[Key, tuple[Drafter, Tree]] = {}
        self._controls: dict[Key, AdaptiveDepth] = {}
        self._choices: dict[tuple[str | None, bool], DrafterChoice] = {}  # (tree, serving) -> auto's choice
        self._served: dict[tuple[int, str], Drafter] = {}  # auto in the serving scheduler: (slot, drafter)
        self._served_controls: dict[str, AdaptiveDepth] = {}  # … drafter -> its controller, shared by slots

    def build(self, drafter: str, tree: str | None = None) -> tuple[Drafter, Tree]:
        """A fresh instance (its own caches) with these settings; (drafter, tree shape)."""
        shape = self.settings.shape_for(drafter, tree, self.model.manifest)
        m = self.model
        ctx = DrafterContext(m.bundle, m.manifest, m.capacity, m.threads, shape, dict(self.settings.drafter_options),
                             m.backend, self.costs, m.note)
        return make_drafter(drafter, ctx), shape

    def get(self, key: Key) -> tuple[Drafter, Tree]:
        """The pool's instance for `key`, built on first use."""
        if key not in self._instances:
            self._instances[key] = self.build(key.drafter, key.tree)
        return self._instances[key]

    def controller(self, key: Key) -> AdaptiveDepth:
        """The adaptive-depth controller of `key`'s drafter, begun for a new sequence and kept across
        generations: the costs it measured carry over, its acceptance counts at half weight."""
        if key not in self._controls:
            self._controls[key] = AdaptiveDepth(self.settings.depth_of(self.get(key)[1]), curve=self.costs())
        return self._controls[key].begin()

    def forget(self) -> None:
        """Every drafter built so far drops its memory of earlier sequences (suffix's store)."""
        for inst, _ in self._instances.values():
            inst.forget()

    # ── auto: the drafter of each request by measured pay-off (runtime/payoff.py) ───────────────────
    def choice(self, tree: str | None, serving: bool) -> DrafterChoice:
        """auto's choice for drafters of shape `tree`; batch-1 generation and the serving scheduler (whose
        passes are batched: other costs) each keep their own."""
        key = (tree, serving)
        if key not in self._choices:
            self._choices[key] = DrafterChoice(self.auto_candidates)
        return self._choices[key]

    def pick(self, tree: str | None, scope: str | None) -> Pick:
        """auto, at the start of a batch-1 request: the drafter the measured pay-offs pick."""
        choice = self.choice(tree, serving=False)
        return choice.choose({d: payoff(self._controls.get(Key(d, tree, scope))) for d in choice.candidates})

    def served(self, slot: int, tree: str | None) -> tuple[Drafter, AdaptiveDepth | None]:
        """auto in the serving scheduler: (drafter, adaptive controller or None: plain) for the request KV
        slot `slot` admits now. The choice and one controller per drafter are shared by the slots (they measure
        the batched passes the server runs); each slot has its own drafter instances (caches), slot 0 the
        pool's own, as `generate` uses them."""
        choice = self.choice(tree, serving=True)
        name = choice.choose({d: payoff(self._served_controls.get(d)) for d in choice.candidates}).drafter
        own, shape = self.get(Key(name, tree))
        if (slot, name) not in self._served:
            inst = own if slot == 0 else self.build(name, tree)[0]
            inst.share(own)  # one server-wide memory of earlier sequences (suffix's store)
            self._served[(slot, name)] = inst
        if name == PLAIN:
            return self._served[(slot, name)], None
        if name not in self._served_controls:
            self._served_controls[name] = AdaptiveDepth(self.settings.depth_of(shape))
        return self._served[(slot, name)], self._served_controls[name]  # the scheduler begins it
