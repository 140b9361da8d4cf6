"""A learned drafter with suffix decoding in front of it (as ArcticInference pairs suffix decoding with its
speculators): each step drafts from the suffix tree where that is predicted to pay more than the learned
drafter's draft, and the learned drafter's draft otherwise.

The suffix tree's score (runtime/drafters/suffix.py: its counts taken as the truth) is optimistic where the
text does not repeat: a short match in open chat scores 1 and is accepted far less. So the expectation is
the score times this sequence's record of the suffix drafts so far, (accepted + PRIOR) / (scored + PRIOR):
a sequence whose suffix drafts are rejected soon drafts from the head alone, one that repeats itself keeps
the suffix drafts.

Which draft a step takes (`choose`):
  priced     where the generator has this machine's verify cost curve c(n) and the learned drafter was
             sized on it (its Shape: predicted speed-up S_h at its first-draft acceptance a_1), the
             default. The suffix draft's first k nodes (a tree of their own: nodes come best first) are
             predicted to give S_s(k) = (1 + record · Σ_{i≤k} p_i) · c(1) / c(1 + k) committed tokens per
             plain pass's time (p_i: node i's weighted path probability); the learned drafter S_h scaled by
             this sequence's record of its own drafts, (1 + a) / (1 + a_1) with a = (accepted + PRIOR · a_1)
             / (drafted + PRIOR). The step takes the suffix draft's best prefix where its S_s beats that, so
             a long chain is cut to the nodes that pay for their rows, and a short match likely enough to be
             accepted wins over a head that does poorly on this text.
  threshold  `suffix_threshold` given (or no cost curve): the whole suffix draft where record · score is
             at least the threshold (DEFAULT_THRESHOLD tokens without one).

Where the text repeats itself or earlier sequences (a rewrite, code, a list), the suffix tree drafts long
chains that are accepted nearly whole, for the cost of a lookup; elsewhere the learned head's one or two
drafts are the better bet. Both keep up with every committed token (`observe`), so either may draft the
next step: the learned drafter's next pass catches up on the rows it did not draft. Each step's proposal is
one drafter's (the suffix draft possibly cut to a prefix), with that drafter's q (suffix: deterministic), so
the target's verify keeps greedy output equal to plain and sampled output on the target's distribution, as
each drafter alone does.

Options (DrafterContext.options): `suffix_threshold` (given: the threshold rule), and the two drafters' own.
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
        given = ctx.options.get("suffix_threshold")
        self.threshold = float(DEFAULT_THRESHOLD if given is None else given)
        if self.threshold < 0:
            raise SpecrtError(f"suffix_threshold {self.threshold} is below 0: it is a number of expected tokens")
        self.model = self.learned(ctx)
        self.suffix = Suffix(ctx)
        self.suffix_steps = 0  # steps the suffix tree drafted
        self.curve = None if given is not None else self._priced_on(ctx)
        self._new_sequence()

    def _priced_on(self, ctx: DrafterContext):
        """The verify cost curve the priced rule uses: the generator's, where the learned drafter was sized on
        it (a Shape with its predicted speed-up and first-draft acceptance); else None (the threshold rule)."""
        chosen = getattr(self.model, "chosen", None)
        if chosen is None or not getattr(chosen, "acceptance", None) or not chosen.speedup > 0:
            return None
        return ctx.costs()

    def _new_sequence(self) -> None:
        self.scored = self.accepted = 0.0  # this sequence's suffix drafts: their scores, their accepted nodes
        self.drafted = self.head_accepted = 0.0  # ... the learned drafter's steps, their first drafts accepted
        # (committed length, draft, whether the suffix tree drafted it) of the step in flight
        self._pending: tuple[int, Proposal, bool] | None = None
        self._length, self._last = 0, None  # the sequence observed last: its length and last token

    @property
    def record(self) -> float:
        """What this sequence's suffix drafts have delivered per token they were scored at."""
        return (self.accepted + PRIOR) / (self.scored + PRIOR)

    @property
    def head_acceptance(self) -> float:
        """The learned drafter's first-draft acceptance on this sequence: its steps so far, from PRIOR steps at
        its sized acceptance a_1."""
        a1 = self.model.chosen.acceptance[0]
        return (self.head_accepted + PRIOR * a1) / (self.drafted + PRIOR)

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
            start, draft, from_suffix = self._pending
            got = accepted_of(draft, list(tokens[start:]))
            if from_suffix:
                self.accepted += got
            else:
                self.drafted, self.head_accepted = self.drafted + 1, self.head_accepted + min(got, 1)
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
        draft, scores = self.suffix.scored_nodes(tokens, max_nodes, max_depth)
        take = self.choose(scores)
        if take:
            self.suffix_steps += 1
            draft = draft if take == len(draft) else Proposal(draft.tokens[:take], draft.parents[:take])
            self.scored += sum(scores[:take])
            self._pending = (len(tokens), draft, True)
            return draft
        proposal = self.model.propose(tokens, max_nodes, max_depth, sampling, rng)
        if self.curve is not None and len(proposal):
            self._pending = (len(tokens), proposal, False)
        return proposal

    def choose(self, scores: list[float]) -> int:
        """How many of the suffix draft's nodes (node scores `scores`, best first) this step drafts; 0: the
        learned drafter drafts it (the module doc's rules)."""
        if not scores:
            return 0
        if self.curve is None:
            return len(scores) if sum(scores) * self.record >= self.threshold else 0
        c1, chosen = self.curve(1), self.model.chosen
        head = chosen.speedup * (1 + self.head_acceptance) / (1 + chosen.acceptance[0])
        best, take, expected = head, 0, 1.0
        for k, p in enumerate(scores, start=1):
            expected += self.record * p
            if (s := expected * c1 / self.curve(1 + k)) > best:
                best, take = s, k
        return take


class Eagle3SuffixFirst(SuffixFirst):
    name = "eagle3-suffix"
    learned = Eagle3
