"""Per-generation statistics: tokens, passes, acceptance by draft depth, time per stage."""

from __future__ import annotations

from dataclasses import dataclass, field

from specrt.runtime.clock import Clock

STAGES = ("prefill", "propose", "verify", "accept", "commit")


@dataclass
class Stats:
    new_tokens: int = 0
    seconds: float = 0.0
    steps: int = 0  # target passes after prefill
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # by depth in the tree
    plain_steps: int = 0  # adaptive depth chose plain decoding (speculation did not pay)
    depth_sum: int = 0  # draft depth limits chosen, summed over steps (adaptive)
    draft_calls: int = 0  # drafter engine calls (layer passes, fuses, head sessions) while proposing
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """τ: tokens committed per target verify pass (accepted drafts + the bonus token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafted tokens over drafted tokens (tree nodes count as drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_draft_depth(self) -> float:
        return self.depth_sum / self.steps if self.steps else 0.0

    def record(self, drafted: int, accepted: int) -> None:
        """One verify pass: `drafted` tree nodes, of which `accepted` (a path from the root) were taken."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.accepted_per_position.extend([0] * (accepted - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def record_depth(self, depth: int) -> None:
        """The draft depth limit adaptive depth chose for a step (0: a plain step, no draft)."""
        self.depth_sum += depth
        self.plain_steps += depth == 0

    def to_dict(self) -> dict:
        return {"new_tokens": self.new_tokens, "seconds": round(self.seconds, 4),
                "tokens_per_s": round(self.tokens_per_s, 2), "steps": self.steps,
                "mean_accepted_len": round(self.mean_accepted_len, 4),
                "acceptance_rate": round(self.acceptance_rate, 4), "drafted": self.drafted,
                "accepted": self.accepted, "accepted_per_position": self.accepted_per_position,
                "plain_steps": self.plain_steps, "mean_draft_depth": round(self.mean_draft_depth, 3),
                "draft_calls": self.draft_calls,
                "draft_calls_per_step": round(self.draft_calls / self.steps, 3) if self.steps else 0.0,
                "stage_seconds": {k: round(v, 4) for k, v in self.stage_seconds.items()}}


@dataclass
class Result:
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS) or "length" (max_new_tokens or KV capacity)
    stats: Stats
    text: str = ""
    lossy: bool = False  # True when a lossy acceptance rule (typical) produced it
    lossless: bool = True  # False when the target's passes were not exact here or the rule was lossy
    drafter: str = ""  # the runtime drafter that proposed (with --drafter auto: the one this request chose)


class Timer:
    """Adds the seconds its block took to `stage`, read from `clock`: the sequence's (runtime/clock.py), so
    that what adaptive depth learns a stage costs is measured the way the sequence measures the rest."""

    def __init__(self, stats: Stats, stage: str, clock: Clock):
        self.stats, self.stage, self.clock = stats, stage, clock

    def __enter__(self):
        self.t0 = self.clock()
        return self

    def __exit__(self, *exc):
        self.elapsed = self.clock() - self.t0
        self.stats.stage_seconds[self.stage] += self.elapsed
