"""Drafters propose a tree of tokens for the target to verify; one small protocol, registered by name.

    drafter.propose(tokens, limits, sampling, rng) -> Proposal   (nodes after the last token)
    drafter.observe(tokens, state)                                (the committed sequence and the target's
                                                                   hidden states of all but its last token)
    drafter.finish(tokens)                                        (a sequence ended: prompt and output)
    drafter.share(other)                                          (read and feed `other`'s memory of
                                                                   earlier sequences)

A `Proposal` lists drafted tokens in window order (parents before children, siblings in rank
order) with each node's window parent (0 = the root, i.e. the last committed token) and, for
stochastic drafts, the distribution each node was drawn from. A chain is the one-path case.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specrt.runtime.sampling import SamplingParams
from specrt.runtime.tree import Tree


def renumber(keep: list[int], parents) -> list[int]:
    """Parents of the kept window nodes `keep` (ascending; every kept node's parent kept or the root),
    renumbered to the compacted window."""
    slot = {0: 0, **{w: j + 1 for j, w in enumerate(keep)}}
    return [slot[parents[w]] for w in keep]


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # window index of each node's parent; 0 = root
    q: np.ndarray | None = None  # [N, V]: distribution node i was drawn from; None: deterministic
    # a greedy chain's drafts: the drafter's own probability that the chain holds up to node i (the product
    # of each step's top-1 probability); None where the drafter does not say
    confidence: list[float] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def tree(self) -> Tree:
        return Tree.from_parents([-1, *self.parents])

    def first_path(self) -> Proposal:
        """The chain of top-ranked children from the root (a chain is returned as it is): what a backend
        that verifies chains only (`--backend ort-fused`) verifies of a tree."""
        tree = self.tree()
        if tree.is_chain:
            return self
        keep, node = [], 0
        while kids := tree.children(node):
            node = kids[0]  # siblings are in rank order
            keep.append(node)
        return self._subset(keep)

    def limited(self, max_nodes: int, max_depth: int) -> Proposal:
        """Keep the nodes within both limits (a prefix in window order stays a valid tree)."""
        if max_nodes <= 0 or max_depth <= 0:
            return Proposal()
        keep = self.tree().kept(max_nodes, max_depth)  # window nodes
        return self if len(keep) == len(self) else self._subset(keep)

    def _subset(self, keep: list[int]) -> Proposal:
        """The window nodes `keep` (ascending; each one's parent kept or the root) as a proposal."""
        return Proposal([self.tokens[w - 1] for w in keep], renumber(keep, [-1, *self.parents]),
                        None if self.q is None else self.q[[w - 1 for w in keep]])


@dataclass
class DrafterContext:
    """What a drafter may need to build itself: the bundle, its manifest and runtime settings."""

    bundle: Path
    manifest: object
    capacity: int
    threads: int
    tree: Tree
    options: dict
    backend: str = "ort"  # the target's backend (engines/registry.py): where feature layers may run natively
    costs: Callable[[], object] = lambda: None  # the verify cost curve here (runtime/costs.py), or None
    note: Callable[[str], None] = lambda text: None  # a one-line notice for the user (TargetModel.note)

    def target_embedding(self):
        """The target graph's embedding table [V, H] (engines/tables.py EmbeddingTable: float rows or int8 blocks),
        mapped read-only from its data file: the rows a feature layer's `inputs_embeds` reads (a drafter's
        embedding is the target's)."""
        from specrt.engines.tables import embedding_table

        return embedding_table(self.bundle / self.manifest.target.file)

    def session(self, graph: str):
        """An ONNX Runtime CPU session of the bundle's drafter graph `graph`, its idle workers not
        spinning (they would steal the cores from the target's pass)."""
        import onnxruntime as ort

        from specrt.engines.ort_cpu.runner import session_options

        return ort.InferenceSession(str(self.manifest.onnx_path(self.bundle, graph)),
                                    session_options(self.threads, spin=False), providers=["CPUExecutionProvider"])


class Drafter:
    """The base of every runtime drafter (registered by its kind's spec in specrt/kinds/)."""

    name: str
    needs_hidden = False  # True: `observe` needs the target's hidden states (learned feature drafters)
    chosen = None  # the shape this drafter sized to the machine's costs (runtime/shapes.py), where it did

    @property
    def engine_calls(self) -> int:
        """Engine calls (graph sessions, native passes) this drafter has made so far: what a step's proposal
        costs in calls (`--json` stats `draft_calls`); 0 for drafters that run no engine."""
        return 0

    def propose(self, tokens: list[int], max_nodes: int, max_depth: int, sampling: SamplingParams,
                rng: np.random.Generator) -> Proposal:
        raise NotImplementedError

    @classmethod
    def nominal_depth(cls, manifest, options: dict, tree: Tree) -> int:
        """How deep a step drafts with these options and tree shape, before any limit (a model of the
        drafting cost: tools/roofline.py)."""
        return max(int(tree.depth.max()), 1)

    def observe(self, tokens: list[int], state=None) -> None:
        """The committed sequence (and the target's states of all but its last token) after a step."""

    def finish(self, tokens: list[int]) -> None:
        """A sequence ended with these committed tokens (prompt and output): a drafter that learns from
        earlier sequences (suffix) keeps them; the next `observe` starts a new sequence."""

    def forget(self) -> None:
        """Drop the memory of earlier sequences (a no-op for drafters without one)."""

    def share(self, other: Drafter) -> None:
        """Use `other`'s memory of earlier sequences as this drafter's own, so what either learns the
        other reads (the serving scheduler's slots share one); a no-op for drafters without one."""


def runtime_names(kind: str) -> tuple[str, ...]:
    """The runtime drafters that use a learned kind's graphs (bundle manifest "drafters")."""
    from specrt.kinds import kinds

    spec = kinds().get(kind)
    return tuple(spec.runtime) if spec else ()


def make_drafter(name: str, ctx: DrafterContext) -> Drafter:
    """Runtime drafter `name` for the bundle; a name whose kind the bundle lacks is refused in one line
    listing every drafter the bundle runs and how to add the missing one."""
    from specrt.errors import SpecrtError
    from specrt.kinds import kind_of, not_in_bundle, resolve

    spec = kind_of(name)
    if not spec.available_in(ctx.manifest):
        raise SpecrtError(not_in_bundle(name, ctx.manifest, ctx.bundle))
    return resolve(spec.runtime[name])(ctx)
