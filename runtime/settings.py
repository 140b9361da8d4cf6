"""Frozen settings: how a generator speculates, and what one sequence is and is held to.

    SpecSettings    draft tokens, tree shape, adaptive depth, drafter options: shared by every drafter
    Request         one generation: prompt, length, sampling, logit bias, logprobs
    SequenceTerms   what the target holds each sequence to: capacity, end tokens, rule, exactness
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from specrt.runtime.sampling import SamplingParams
from specrt.runtime.tree import Tree, resolve_tree


@dataclass(frozen=True)
class SpecSettings:
    """The speculation settings every drafter of a generator shares (`Generator.configure` replaces them)."""

    num_draft_tokens: int = 5  # chain length when no tree is given; the deepest draft with adaptive depth
    tree: str | None = None  # a tree shape (runtime/tree.py); None: the chain, or the drafter's exported tree
    adaptive: bool = False  # choose the draft depth each step (runtime/adaptive.py)
    drafter_options: Mapping = field(default_factory=dict)  # per-drafter knobs (beam, tree_nodes, mtp_steps…)
    shape: Tree = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "num_draft_tokens", int(self.num_draft_tokens))
        object.__setattr__(self, "drafter_options", MappingProxyType(dict(self.drafter_options)))
        object.__setattr__(self, "shape", resolve_tree(self.tree, self.num_draft_tokens))  # bad shapes fail now

    def shape_for(self, drafter: str, tree: str | None, manifest) -> Tree:
        """The tree a drafter drafts: `tree` if given, else these settings' one, except that a drafter
        exported with a tree of its own (manifest) keeps it unless the settings name one."""
        if tree is not None:
            return resolve_tree(tree, self.num_draft_tokens)
        stored = manifest.drafter_tree(drafter)
        return Tree.from_paths(stored) if self.tree is None and stored else self.shape

    def depth_of(self, tree: Tree) -> int:
        """The deepest draft a drafter of shape `tree` may take (adaptive depth picks 0..this)."""
        return max(self.num_draft_tokens, int(tree.depth.max()) if tree.size > 1 else 1)


@dataclass(frozen=True)
class Request:
    """One generation's own terms."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 128
    sampling: SamplingParams | None = None
    logit_bias: Mapping[int, float] | None = None  # runtime/logits.py
    logprobs: int | None = None  # top-N log-probabilities per committed token; None: off

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", MappingProxyType(dict(self.logit_bias)))


@dataclass(frozen=True)
class SequenceTerms:
    """What a target holds every sequence in it to."""

    capacity: int  # KV rows per sequence
    eos: frozenset[int] = frozenset()
    acceptance: str | None = None  # the acceptance rule (runtime/acceptance.py); None: the exact default
    exact: bool = True  # the target's passes give plain decoding's rows here (runtime/exactness.py)
    chains_only: bool = False  # the target verifies chains only: a tree proposal is cut to its first path
