"""Time as a test's script says: a drafter whose proposals, and target passes which, cost fixed seconds on a
`FakeClock` (runtime/clock.py). A generator built with that clock measures only those seconds, so what
adaptive depth and the scheduler's pass plan choose from them is the same on a machine of any speed."""

from __future__ import annotations

from dataclasses import dataclass

from specrt.runtime.clock import FakeClock
from specrt.runtime.drafters import Drafter, Proposal

VOCAB = 49152  # the tiny bundle's


@dataclass
class Script:
    """What `ScriptedDrafter` drafts after one prompt."""

    continuation: list[int]  # the target's greedy continuation of the prompt
    right: bool = True  # draft it (always accepted), or start each draft with a token the target never picks
    seconds: float = 0.0  # what each proposal costs on the clock


class ScriptedDrafter(Drafter):
    """Drafts, after a prompt in `scripts`, a chain from its `Script`, advancing `clock` by the script's
    seconds for every proposal; after any other prompt, nothing."""

    name = "scripted"

    def __init__(self, scripts: dict[tuple[int, ...], Script], clock: FakeClock):
        self.scripts, self.clock = scripts, clock

    def propose(self, tokens, max_nodes, max_depth, sampling, rng):
        for prompt, script in self.scripts.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                self.clock.advance(script.seconds)
                n = len(tokens) - len(prompt)
                nodes = script.continuation[n : n + min(max_nodes, max_depth)]
                if not script.right and nodes:
                    nodes = [(nodes[0] + 1) % VOCAB, *nodes[1:]]
                return Proposal(list(nodes), list(range(len(nodes))))  # a chain
        return Proposal()

    def observe(self, tokens, state=None) -> None:
        pass


def paced(target, clock: FakeClock, seconds: float):
    """A target's passes advancing `clock` by `seconds` a pass, whatever its shape. `target`: a Generator
    (the result is a serving scheduler's `runner`), or a decoder's `run_all` (install it as
    `gen.target.run_all = paced(gen.target.run_all, clock, seconds)`)."""
    if hasattr(target, "model"):
        def runner(bp):
            clock.advance(seconds)
            return target.model.run_batch(bp.windows, bp.start)

        return runner

    def run(*args, **kwargs):
        clock.advance(seconds)
        return target(*args, **kwargs)

    return run
