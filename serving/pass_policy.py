"""How the scheduler spends a step over n > 1 decoding sequences: drafts, or plain rows batched.

On a backend that batches one row per sequence (`ort-fused`: GroupQueryAttention takes several new
rows after a cached prefix only at batch 1) a step is one of

    batched   ONE pass over all n slots, one row each (plain decoding of each)   n tokens / c(n, 1)
    drafted   n batch-1 passes, each slot its own draft window of T_s rows        Σ E_s / Σ c(1, T_s)

and on one that batches windows (`ort`) one of

    batched   as above                                                           n tokens / c(n, 1)
    windows   ONE pass over all n slots, each its draft, padded to the longest   Σ E_s / c(n, max T_s)

c(b, t) is the measured seconds of a pass over b sequences of t rows each (`PassCosts`: what this
scheduler's passes took, smoothed). On a backend whose passes are ragged (`native`: each sequence's rows
one after the other, no padding) a pass costs what its rows do, so there c(b, t) is keyed by the pass's
total rows t: batched n tokens / c(b, n), windows Σ E_s / c(b, Σ T_s) (b: the slot range the pass spans,
whose idle slots run no rows). E_s is the tokens a drafted pass commits for slot s (its own
smoothed record, starting from the server's). The plan with more tokens per second runs. So
speculation backs off as the batch fills: drafting pays while few sequences decode (a batch-1 pass
of T rows costs little more than one of a single row), batching once the single-row pass over many
slots commits more per second than the drafts do. A cost not measured yet is explored first: each plan
is tried once before the estimates decide. Both plans commit exactly what plain decoding commits (the
batch check of runtime/invariance.py covers one row per slot), so the choice changes speed only.
"""

from __future__ import annotations

SMOOTHING = 0.2  # weight of the newest observation in each moving average


class PassCosts:
    """Smoothed seconds of a target pass by shape (sequences, rows per sequence)."""

    def __init__(self):
        self.seconds: dict[tuple[int, int], float] = {}

    def observe(self, batch: int, rows: int, seconds: float) -> None:
        key = (batch, rows)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else (1 - SMOOTHING) * old + SMOOTHING * seconds

    def get(self, batch: int, rows: int) -> float | None:
        """The measured cost, else one estimated from the nearest measured shape with as many sequences
        (scaled by rows: a pass costs at most in proportion to its rows), else None."""
        if (batch, rows) in self.seconds:
            return self.seconds[(batch, rows)]
        same = [(t, s) for (b, t), s in self.seconds.items() if b == batch]
        if not same:
            return None
        t, s = min(same, key=lambda ts: abs(ts[0] - rows))
        return s * max(rows, 1) / t if rows > t else s


class Yield:
    """Smoothed tokens a drafted pass commits, per slot, starting from the server-wide figure."""

    def __init__(self, prior: float = 2.0):
        self.server = prior
        self.slot: dict[int, float] = {}

    def observe(self, slot: int, tokens: int) -> None:
        self.server = (1 - SMOOTHING) * self.server + SMOOTHING * tokens
        old = self.slot.get(slot, self.server)
        self.slot[slot] = (1 - SMOOTHING) * old + SMOOTHING * tokens

    def forget(self, slot: int) -> None:
        """A new sequence in `slot`: it starts from the server-wide figure."""
        self.slot.pop(slot, None)

    def of(self, slot: int) -> float:
        return self.slot.get(slot, self.server)


def choose(slots: list[int], batch: int, window_rows: dict[int, int], costs: PassCosts, yields: Yield,
           batch_windows: bool = False, ragged: bool = False) -> str:
    """"batched", or the drafts' plan — "windows" where the backend batches windows, else "drafted" — for a
    step over decoding `slots` (more than one); `batch`: the sequences the batched pass would span (the KV
    slot range, idle slots in it included); `window_rows[s]`: the rows slot s's draft would have (its last
    one); `ragged`: the backend's passes are ragged and `costs` keyed by total rows (pass_rows). A plan whose
    cost is not measured yet is explored first."""
    batched = costs.get(batch, len(slots) if ragged else 1)
    if batched is None:
        return "batched"
    plan, cost = ("windows", _ragged_cost if ragged else _windows_cost) if batch_windows else ("drafted", _drafted_cost)
    seconds = cost(slots, batch, window_rows, costs)
    if seconds is None:
        return plan
    return plan if sum(yields.of(s) for s in slots) / seconds > len(slots) / batched else "batched"


def _windows_cost(slots: list[int], batch: int, window_rows: dict[int, int], costs: PassCosts) -> float | None:
    """One pass over `batch` sequences, every window padded to the longest (None until a drafted pass at
    this batch was measured)."""
    if not any(b == batch and t > 1 for b, t in costs.seconds):
        return None
    return costs.get(batch, max(window_rows[s] for s in slots))


def _ragged_cost(slots: list[int], batch: int, window_rows: dict[int, int], costs: PassCosts) -> float | None:
    """One ragged pass over `batch` sequences: every window's rows, no padding (None until a drafted pass at
    this batch was measured)."""
    rows = sum(window_rows[s] for s in slots)
    if not any(b == batch and t > len(slots) for b, t in costs.seconds):
        return None
    return costs.get(batch, rows)


def pass_rows(row_counts: list[int], ragged: bool) -> int:
    """The rows a pass's cost is keyed by: the total of a ragged pass's windows, else the longest (every
    window padded to it)."""
    return sum(row_counts) if ragged else max(row_counts)


def _drafted_cost(slots: list[int], batch: int, window_rows: dict[int, int], costs: PassCosts) -> float | None:
    """One batch-1 pass per slot over its own window (None until each such shape was measured)."""
    each = [costs.get(1, window_rows[s]) for s in slots]
    return None if any(c is None for c in each) else sum(each)
