"""A learned drafter with suffix decoding in front of it (as ArcticInference pairs suffix decoding with its
speculators): each step drafts the suffix tree where it expects at least `suffix_threshold` tokens
accepted, and the learned drafter's draft otherwise.

The suffix tree's score (runtime/drafters/suffix.py: its counts taken as the truth) is optimistic where the
text does not repeat: a short match in open chat scores 1 and is accepted far less. So the expectation is
the score times this sequence's record of the suffix drafts so far, (accepted + PRIOR) / (scored + PRIOR):
a sequence whose suffix drafts are rejected soon drafts from the head alone, one that repeats itself keeps
the suffix drafts.

Where the text repeats itself or earlier sequences (a rewrite, code, a list), the suffix tree drafts long
chains that are accepted nearly whole, for the cost of a lookup; elsewhere the learned head's one or two
drafts are the better bet. Both keep up with every committed token (`observe`), so either may draft the
next step: the learned drafter's next pass catches up on the rows it did not draft. Each step's proposal is
one drafter's, with that drafter's q (suffix: deterministic), so the target's verify keeps greedy output
equal to plain and sampled output on the target's distribution, as each drafter alone does.

Options (DrafterContext.options): `suffix_threshold` (default DEFAULT_THRESHOLD), and the two drafters' own.
"""

from __future__ import annotations

from specrt.errors import SpecrtError
from specrt.runtime.drafters import Drafter, DrafterContext, Proposal
from specrt.runtime.drafters.eagle import Eagle3
from specrt.runtime.drafters.suffix import Suffix
from specrt.runtime.sampling import SamplingParams

DEFAULT_THRESHOLD = 1.0  # the suffix tree's expected accepted tokens at which its draft is taken
PRIOR = 2.0  # tokens: the record a sequence starts with (scored and accepted alike)


def accepted_of(proposal: Proposal, committed: list[int]) -> int:
    """How many nodes of `proposal` the tokens `committed` after its root accepted: the deepest path of it
    they follow (the last committed token is the target's own, never a draft)."""
    node, depth = 0, 0
    for token in committed[:-1]:
        child = next((i + 1 for i, (t, p) in enumerate(zip(proposal.tokens, proposal.parents, strict=True))
                      if p == node and t == token), None)
        if child is None:
            break
        node, depth = child, depth + 1
    return depth


class SuffixFirst(Drafter):
    """The base: a subclass names its learned drafter (`learned`, a runtime drafter class)."""

    learned: type[Drafter]
    needs_hidden = True

    def __init__(self, ctx: DrafterContext):
        self.threshold = float(ctx.options.get("suffix_threshold", DEFAULT_THRESHOLD))
        if self.threshold < 0:
            raise SpecrtError(f"suffix_threshold {self.threshold} is below 0: it is a number of expected tokens")
        self.model = self.learned(ctx)
        self.suffix = Suffix(ctx)
        self.suffix_steps = 0  # steps the suffix tree drafted
        self._new_sequence()

    def _new_sequence(self) -> None:
        self.scored = self.accepted = 0.0  # this sequence's suffix drafts: their scores, their accepted nodes
        self._pending: tuple[int, Proposal] | None = None  # (committed length, draft) of a suffix step
        self._length, self._last = 0, None  # the sequence observed last: its length and last token

    @property
    def record(self) -> float:
        """What this sequence's suffix drafts have delivered per token they were scored at."""
        return (self.accepted + PRIOR) / (self.scored + PRIOR)

    @property
    def chosen(self):
        return self.model.chosen

    @property
    def engine_calls(self) -> int:
        return self.model.engine_calls

    @property
    def layer(self):
        """The learned drafter's layer (where it has one): `--json` reports where it runs."""
        return getattr(self.model, "layer", None)

    @property
    def layers(self):
        return getattr(self.model, "layers", None)

    def observe(self, tokens: list[int], state=None) -> None:
        if len(tokens) < self._length or (self._length and tokens[self._length - 1] != self._last):
            self._new_sequence()  # another sequence (the generator reused for the next prompt)
        if self._pending is not None:
            start, draft = self._pending
            self.accepted += accepted_of(draft, list(tokens[start:]))
            self._pending = None
        self._length, self._last = len(tokens), tokens[-1] if tokens else None
        self.suffix.observe(tokens)
        self.model.observe(tokens, state)

    def finish(self, tokens: list[int]) -> None:
        self.suffix.finish(tokens)
        self.model.finish(tokens)
        self._new_sequence()

    def forget(self) -> None:
        self.suffix.forget()
        self.model.forget()
        self._new_sequence()

    def share(self, other: Drafter) -> None:
        if isinstance(other, SuffixFirst):
            self.suffix.share(other.suffix)
            self.model.share(other.model)

    def propose(self, tokens, max_nodes, max_depth, sampling: SamplingParams, rng) -> Proposal:
        draft, score = self.suffix.scored(tokens, max_nodes, max_depth)
        if len(draft) and score * self.record >= self.threshold:
            self.suffix_steps += 1
            self.scored += score
            self._pending = (len(tokens), draft)
            return draft
        return self.model.propose(tokens, max_nodes, max_depth, sampling, rng)


class Eagle3SuffixFirst(SuffixFirst):
    name = "eagle3-suffix"
    learned = Eagle3
