"""The serving scheduler's step as data: `plan` says what the next step's target passes carry, `apply`
commits what they returned. Neither holds a thread, a clock or a lock; the driver (serving/scheduler.py)
owns those, runs each planned pass on the `TargetModel` and delivers the events.

    plan(admit)           -> StepPlan   1. cancelled or stopped sequences end (their slots are free again)
                                        2. the requests in `admit` claim free KV slots (a sequence each,
                                           its prompt cut into prefill chunks)
                                        3. ONE prefill chunk: the oldest admission still prefilling
                                        4. the decoding sequences' rows: each one's draft window, or one
                                           plain row each, by the measured pass costs (pass_policy.py)
    apply(plan, outputs)  -> [Event]    each pass's rows accepted and committed (ragged acceptance);
                                        the tokens to deliver, the requests that ended

So a long prompt delays the others by one chunk per step, never by its whole prefill. A sequence whose
last chunk ran decodes from the next step on. Every decoding sequence runs exactly `runtime/sequence.py`
(plan → target pass → commit), the code `specrt generate` runs, and the target computes every row of a
batched pass as it computes it alone (the bundle's batch-invariance check), so a served greedy request
returns the same tokens as a lone one.

With several sequences decoding, step 4 follows whichever plan commits more tokens per second
(pass_policy.py): ONE pass over every decoding slot with a single row each ("batched"), or the drafts —
in that one pass where the backend batches windows ("windows"), else one batch-1 pass per slot
("drafted"). Each slot has its own drafter, target state and adaptive-depth controller; every slot's
drafter shares the generator's memory of earlier sequences (`Drafter.share`), which each finished
sequence joins (`Drafter.finish`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from specrt.engines.registry import backend_entry
from specrt.errors import SpecrtError
from specrt.runtime.adaptive import AdaptiveDepth
from specrt.runtime.batch import BatchOutputs
from specrt.runtime.generate import Generator
from specrt.runtime.sequence import PREFILL_CHUNK, Pass, Sequence
from specrt.runtime.stats import Result
from specrt.runtime.target import WINDOW_MARGIN
from specrt.runtime.tree import Tree
from specrt.serving import pass_policy
from specrt.serving.handle import Handle
from specrt.serving.prefix_cache import PrefixCache

BATCH_HISTORY = 4096  # sequences per decode pass kept (for the bench and tests; the metrics keep the rest)


# ── what a step plans, and what it tells the driver ─────────────────────────────────────────────
@dataclass
class BatchPass:
    """One target pass over KV slots start..start+len(windows)-1. `windows[i]` is slot start+i's window;
    None, or a placeholder, where a slot in the range has nothing in it. `slots` lists the slots it commits
    for: decoding sequences' rows, and `chunk`'s prompt chunk where it carries one."""

    start: int
    windows: list[Pass | None]
    slots: list[int]
    chunk: int | None = None  # the slot whose prompt chunk this pass carries
    final: bool = False  # … and that chunk is its prompt's last (its logits give the first token)

    @property
    def kind(self) -> str:
        """"prefill": a prompt chunk alone; "decode": decode rows (with a prompt chunk beside them, `chunk`)."""
        return "prefill" if self.slots == [self.chunk] else "decode"

    @property
    def stop(self) -> int:
        return self.start + len(self.windows)

    @property
    def decoding(self) -> list[int]:
        return [b for b in self.slots if b != self.chunk]


@dataclass
class StepPlan:
    passes: list[BatchPass]
    events: list[Event]  # what planning already decided: admissions refused, cancellations, ends
    policy: str | None = None  # batched / windows / drafted where several sequences decode


@dataclass
class PassOutput:
    """What the driver got from one planned pass: its outputs and seconds, or the error it raised."""

    outs: BatchOutputs | None
    seconds: float = 0.0
    error: BaseException | None = None


@dataclass
class Delivered:
    """Tokens for a request (its first: `first`), with their logprobs where asked for, and what the
    step drafted and accepted for it."""

    handle: Handle
    tokens: list[int]
    logprobs: list
    first: bool = False
    drafted: int = 0
    accepted: int = 0


@dataclass
class Ended:
    """A request ended: `result` once its sequence ran (None: it ended before, or `error` ended it);
    `reason` its finish reason."""

    handle: Handle
    result: Result | None
    reason: str | None
    error: BaseException | None = None


Event = Delivered | Ended


# ── the KV slots ──────────────────────────────────────────────────────────────────────────────
@dataclass
class Slot:
    index: int
    drafter: object
    state: object
    control: AdaptiveDepth | None
    handle: Handle | None = None  # the request holding this slot
    seq: Sequence | None = None
    prefill: deque[Pass] = field(default_factory=deque)  # prompt chunks not planned yet
    prefill_seconds: float = 0.0
    ready: bool = False  # its first token is out: it decodes
    order: int = 0  # admission number: the oldest prefills first
    window_rows: int = 1  # rows of its last drafted window (what the next one may cost)
    looked_up: bool = True  # its prompt was looked up in the prefix cache (at its first chunk)
    sent_logprobs: int = 0

    @property
    def decoding(self) -> bool:
        return self.seq is not None and self.ready

    @property
    def prefilling(self) -> bool:
        return self.seq is not None and not self.ready

    def idle_window(self) -> Pass | None:
        """This slot's rows in a pass it commits nothing from: None for a free slot; for a prompt not fully
        prefilled, a placeholder asking for no logits. A ragged pass runs nothing for either; a padded one
        runs a dummy row, at row 0 of a free slot, and where the prompt's next chunk (or its first decode
        step) starts, which that overwrites: the rows its earlier chunks filled stay as they are."""
        if self.seq is None:
            return None
        row = self.prefill[0].past if self.prefill else len(self.seq.tokens)
        return Pass(np.zeros(1, np.int64), row, Tree.chain(0), np.zeros(0, np.int64))


class SchedulerCore:
    """The step's decisions over `n_slots` of `gen`'s KV slots (its drafter settings are the server's)."""

    def __init__(self, gen: Generator, n_slots: int, mix_chunks: bool | None = None,
                 prefix: PrefixCache | None = None, prefill_chunk: int = PREFILL_CHUNK):
        """`mix_chunks`: a prompt chunk rides in the decode pass (default: where the target runs ragged
        passes, which need no padding rows for it: native); else it runs as a pass of its own. `prefix`:
        the KV rows of earlier prompts and answers, reused by the requests that start with them (None: none).
        `prefill_chunk`: the prompt rows a step runs (`specrt serve --prefill-chunk`): what a long prompt
        delays the running streams by, a step at a time."""
        if int(prefill_chunk) < 1:
            raise SpecrtError(f"--prefill-chunk {prefill_chunk}: a step runs at least one prompt row; give 1 or more")
        self.gen, self.prefix, self.prefill_chunk = gen, prefix, int(prefill_chunk)
        self.mix_chunks = gen.model.ragged if mix_chunks is None else mix_chunks
        self.slots = [self._new_slot(i) for i in range(n_slots)]
        self.batch_windows = backend_entry(gen.backend).batch_windows
        self.ragged = gen.model.ragged  # passes priced by their total rows (pass_policy.py)
        self.costs, self.yields = pass_policy.PassCosts(), pass_policy.Yield()
        self.plans = {"batched": 0, "drafted": 0, "windows": 0}  # steps of each plan (pass_policy.py)
        self.steps = 0  # decode passes run
        self.batch_sizes: deque[int] = deque(maxlen=BATCH_HISTORY)  # sequences per decode pass, the latest
        self._admitted = 0

    def _new_slot(self, i: int) -> Slot:
        """KV slot i: slot 0 takes the generator's own drafter and target state (those `generate` uses in
        slot 0), the others fresh ones configured the same; each its own adaptive-depth controller."""
        gen = self.gen
        drafter = gen.drafter if i == 0 else gen.fresh_drafter()
        drafter.share(gen.drafter)  # one server-wide memory of earlier sequences (suffix's store)
        return Slot(i, drafter, gen.state if i == 0 else gen.new_state(), gen.new_control())

    @property
    def free(self) -> int:
        """Slots no request holds."""
        return sum(s.handle is None for s in self.slots)

    @property
    def room(self) -> int:
        """Requests the next `plan` can admit: free slots, and those its cancellations free."""
        return sum(s.handle is None or s.handle.cancelled for s in self.slots)

    @property
    def running(self) -> int:
        """Requests holding a slot (prefilling or decoding)."""
        return len(self.slots) - self.free

    # ── plan ─────────────────────────────────────────────────────────────────────────────────
    def plan(self, admit: list[Handle] = ()) -> StepPlan:
        """The next step: cancelled sequences end, `admit` (at most `room` requests, oldest first) claim
        slots, then the passes."""
        events: list[Event] = []
        for slot in self.slots:
            if slot.seq is not None and slot.handle.cancelled:
                slot.seq.cancel(slot.handle.cancel_reason)
                events.append(self._release(slot))
        free = (s for s in self.slots if s.handle is None)
        for handle in admit:
            self._admit(next(free), handle, events)
        chunk = self._prefill_chunk()
        live = [s for s in self.slots if s.decoding]
        policy = self._policy(live)
        if policy is not None:
            self.plans[policy] += 1
        groups = [[s] for s in live] if policy == "drafted" else [live] if live else []
        passes = [bp for group in groups if (bp := self._decode_pass(group, 0 if policy == "batched" else None, events))]
        if chunk is not None:
            if self.mix_chunks and len(passes) == 1:
                passes[0] = self._with_chunk(passes[0], chunk)
            else:
                passes.insert(0, chunk)
        return StepPlan(passes, events, policy)

    def _admit(self, slot: Slot, handle: Handle, events: list[Event]) -> None:
        """`handle` claims `slot`: its sequence, its prompt as prefill chunks (one planned per step)."""
        if handle.cancelled:  # went away after leaving the queue, before its sequence began
            events.append(Ended(handle, None, handle.cancel_reason))
            return
        slot.handle = handle
        try:
            if self.gen.choice is not None:  # `--drafter auto`: this request's drafter, by measured pay-off
                slot.drafter, slot.control = self.gen.served_drafter(slot.index)
            if slot.control is not None:
                slot.control.begin()
            slot.seq = self.gen.sequence(handle.prompt_ids, handle.max_new_tokens, handle.sampling, slot.index,
                                         slot.drafter, slot.state, slot.control, max_nodes=WINDOW_MARGIN - 2,
                                         **handle.options)
        except Exception as e:  # this request fails; the others go on
            events.append(self._fail(slot, e))
            return
        slot.prefill, slot.prefill_seconds = deque(slot.seq.prefill_passes(self.prefill_chunk)), 0.0
        slot.ready = False
        slot.looked_up = False
        slot.window_rows, slot.sent_logprobs = self.gen.max_depth + 1, 0
        slot.order, self._admitted = self._admitted, self._admitted + 1
        self.yields.forget(slot.index)

    def _reuse(self, slot: Slot) -> int:
        """The prompt rows slot's request finds in the prefix cache, copied into its KV slot (a drafter that
        reads the target's features prefills them all: the cache keeps KV rows only). The rows a padded pass
        wrote in the slot before (an idle slot's placeholder at row 0) are overwritten."""
        if self.prefix is None:
            return 0
        blocks = [] if slot.seq.needs_hidden else self.prefix.match(slot.handle.prompt_ids)
        if blocks:
            self.gen.model.set_kv_rows(slot.index, 0, np.concatenate([b.rows for b in blocks], axis=2))
        slot.handle.cached_tokens = len(blocks) * self.prefix.block
        return slot.handle.cached_tokens

    def _remember(self, slot: Slot, rows: int) -> None:
        """The first `rows` of slot's tokens have their KV rows written: the prefix cache keeps them."""
        if self.prefix is not None:
            self.prefix.insert(slot.seq.tokens[:rows], lambda a, b: self.gen.model.kv_rows(slot.index, a, b))

    def _prefill_chunk(self) -> BatchPass | None:
        """The next chunk of the earliest admission whose prompt has chunks left."""
        waiting = [s for s in self.slots if s.prefilling and s.prefill]
        if not waiting:
            return None
        slot = min(waiting, key=lambda s: s.order)
        if not slot.looked_up:  # at its first chunk, not at admission: a burst of requests admitted together
            slot.looked_up = True  # finds what the first of them cached in the steps before
            if cached := self._reuse(slot):
                slot.prefill = deque(slot.seq.prefill_passes(self.prefill_chunk, start=cached))
        p = slot.prefill.popleft()
        return BatchPass(slot.index, [p], [slot.index], slot.index, final=not slot.prefill)

    def _with_chunk(self, decode: BatchPass, chunk: BatchPass) -> BatchPass:
        """The decode pass with the prompt chunk beside its rows, over the slot range both span."""
        at = {b: decode.windows[b - decode.start] for b in decode.decoding}
        at[chunk.chunk] = chunk.windows[0]
        return self._spanning(at, chunk.chunk, chunk.final)

    def _spanning(self, at: dict[int, Pass], chunk: int | None = None, final: bool = False) -> BatchPass:
        """One pass over the KV slot range the windows `at` (by slot) span; an idle slot's placeholder between."""
        lo, hi = min(at), max(at) + 1
        return BatchPass(lo, [at[b] if b in at else self.slots[b].idle_window() for b in range(lo, hi)],
                         sorted(at), chunk, final)

    def _policy(self, live: list[Slot]) -> str | None:
        """How several decoding sequences share this step (None: one, or none, decodes)."""
        if len(live) < 2:
            return None
        if all(getattr(s.drafter, "name", "") == "plain" for s in live):
            return "batched"
        batch = live[-1].index - live[0].index + 1
        return pass_policy.choose([s.index for s in live], batch, {s.index: s.window_rows for s in live},
                                  self.costs, self.yields, self.batch_windows, self.ragged)

    def _decode_pass(self, group: list[Slot], depth_cap: int | None, events: list[Event]) -> BatchPass | None:
        """One pass over `group`'s windows (each drafting at most `depth_cap` deep), over the KV slot range
        they span; sequences that finished (no KV row left) or whose drafter failed end here."""
        windows: dict[int, Pass] = {}
        for slot in group:
            try:
                p = slot.seq.plan(depth_cap)
            except Exception as e:  # this sequence's drafter failed; the others go on
                events.append(self._fail(slot, e))
                continue
            if p is None:
                events.append(self._release(slot))
            else:
                windows[slot.index] = p
        return self._spanning(windows) if windows else None

    # ── apply ────────────────────────────────────────────────────────────────────────────────
    def apply(self, plan: StepPlan, outputs: list[PassOutput]) -> list[Event]:
        """Commit each planned pass's outputs (in plan order); what to deliver and who ended."""
        events: list[Event] = []
        for bp, out in zip(plan.passes, outputs, strict=True):
            if out.error is not None:
                events += [self._fail(self.slots[b], out.error) for b in bp.slots if self.slots[b].seq is not None]
                continue
            if bp.chunk is not None:
                self._absorb(bp, out, events)
            if bp.decoding:
                self._commit(bp, out, events)
        return events

    def _absorb(self, bp: BatchPass, out: PassOutput, events: list[Event]) -> None:
        """The prompt chunk's rows: the features they give a drafter; after the last, the first token."""
        slot = self.slots[bp.chunk]
        try:
            outs = out.outs.of(bp.chunk - bp.start)
            slot.seq.absorb(bp.windows[bp.chunk - bp.start], outs)
            slot.prefill_seconds += out.seconds
            if not bp.final:
                return
            self._remember(slot, len(slot.seq.tokens))
            first = slot.seq.prefilled(outs["logits"][0], slot.prefill_seconds)
            slot.ready = True
            events.append(Delivered(slot.handle, first, self._new_logprobs(slot), first=True))
            if slot.seq.done:
                events.append(self._release(slot))
        except Exception as e:
            events.append(self._fail(slot, e))

    def _commit(self, bp: BatchPass, out: PassOutput, events: list[Event]) -> None:
        """Each sequence of a decode pass accepts and commits its own number of tokens. The pass's seconds
        teach the pass policy its cost unless a prompt chunk rode in it (a shape the policy does not price)."""
        self.steps += 1
        self.batch_sizes.append(len(bp.decoding))
        if bp.chunk is None:
            rows = [len(bp.windows[b - bp.start].window) for b in bp.slots]
            self.costs.observe(len(bp.windows), pass_policy.pass_rows(rows, self.ragged), out.seconds)
        for b in bp.decoding:
            slot, i = self.slots[b], b - bp.start
            p = bp.windows[i]
            try:
                before = slot.seq.stats.accepted
                outs = out.outs.of(i)
                new = slot.seq.commit(p, outs["logits"][0, : len(p.window)], outs, out.seconds)
                accepted = slot.seq.stats.accepted - before
                if not p.capped:
                    slot.window_rows = len(p.window)
                    self.yields.observe(b, accepted + 1)
                events.append(Delivered(slot.handle, new, self._new_logprobs(slot), drafted=len(p.proposal),
                                        accepted=accepted))
                if slot.seq.done:
                    events.append(self._release(slot))
            except Exception as e:
                events.append(self._fail(slot, e))

    @staticmethod
    def _new_logprobs(slot: Slot) -> list:
        new = slot.seq.logprobs[slot.sent_logprobs:]
        slot.sent_logprobs = len(slot.seq.logprobs)
        return new

    # ── ends ─────────────────────────────────────────────────────────────────────────────────
    def abort(self) -> list[Event]:
        """Shutting down: every running sequence ends (finish reason "abort")."""
        events = []
        for slot in self.slots:
            if slot.seq is not None:
                slot.seq.cancel("abort")
                events.append(self._release(slot))
        return events

    def _unclaim(self, slot: Slot) -> Handle:
        handle = slot.handle
        slot.seq = slot.handle = None
        slot.prefill.clear()
        slot.ready = False
        return handle

    def _release(self, slot: Slot) -> Ended:
        seq = slot.seq
        slot.drafter.finish(seq.tokens)  # what every slot's drafter may draft from next (suffix's store)
        if slot.ready:  # its rows up to the last token's (written by the next pass, which will not come)
            self._remember(slot, len(seq.tokens) - 1)
        result = seq.result()
        return Ended(self._unclaim(slot), result, result.finish_reason)

    def _fail(self, slot: Slot, error: BaseException) -> Ended:
        return Ended(self._unclaim(slot), None, None, error)
