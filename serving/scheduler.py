"""The serving scheduler: many requests share each verify pass (continuous batching).

One thread owns the target graph. Each step it
  1. admits waiting requests into free KV slots (a slot is claimed under the lock the moment its request
     leaves the queue, so `submit` never counts it free twice: the queue bound holds under bursts),
  2. drops requests whose client went away (their slot is free for the next admission),
  3. runs ONE prefill chunk (at most PREFILL_CHUNK prompt rows, batch-1, in the slot's view) of the
     oldest sequence still prefilling — a long prompt delays the others by one chunk per step, never by
     its whole prefill,
  4. asks every decoding sequence for its verify window (its own drafter, its own draft),
  5. runs ONE target pass over all of them: windows padded to the longest, each sequence at its own
     `past_len` in its own KV slot (padding rows see only themselves and are never read),
  6. lets every sequence accept and commit its own number of tokens (ragged acceptance).

With several sequences decoding, steps 4-5 follow whichever plan commits more tokens per second by the
measured pass costs (pass_policy.py): ONE pass over every decoding slot with a single row each (plain
decoding), or the drafts — in that one pass where the backend batches windows, else (`ort-fused`:
GroupQueryAttention) one batch-1 drafted pass per slot. Speculation thus backs off as the batch fills.

Each sequence runs exactly `runtime/sequence.py`, the code `specrt generate` runs, and the target's
kernels compute every row of a batched pass as they compute it alone (the bundle's batch-invariance
check; tests/serving/test_scheduler.py holds served output to single-request output), so a served
greedy request returns the same tokens as a lone one. Every slot's drafter is configured like the
generator's current one (`Generator.use`: drafter, tree, options, adaptive depth); each slot has its
own drafter caches, target state and adaptive-depth controller, and every slot's drafter shares the
generator's memory of earlier sequences (`Drafter.share`), which each finished sequence joins
(`Drafter.finish`).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from specrt.engines.registry import backend_entry
from specrt.errors import SpecrtError
from specrt.runtime.adaptive import AdaptiveDepth
from specrt.runtime.clock import Clock
from specrt.runtime.generate import Generator
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.sequence import Pass, Sequence, check_prompt, pack_windows
from specrt.runtime.stats import Result
from specrt.runtime.target import WINDOW_MARGIN
from specrt.runtime.tree import Tree
from specrt.serving import pass_policy
from specrt.serving.metrics import Metrics


class SchedulerFull(SpecrtError):
    """Every slot is busy and the waiting queue is full (HTTP 503)."""


_DONE = object()
BATCH_HISTORY = 4096


class Handle:
    """One submitted request: iterate (sync or async) for token chunks; `result` once finished.
    `cancel()` (the client went away) or `stop()` (the client has what it wanted: a stop sequence
    matched) frees its slot, or its place in the queue, at the scheduler's next step."""

    def __init__(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams,
                 loop: asyncio.AbstractEventLoop | None, options: dict | None = None,
                 clock: Clock = time.perf_counter):
        """`options`: more `Generator.sequence` arguments (`logit_bias`, `logprobs`); `clock`: the
        scheduler's, which `submitted` and `first_token_at` are read from."""
        self.prompt_ids, self.max_new_tokens, self.sampling = prompt_ids, max_new_tokens, sampling
        self.options = dict(options or {})
        self.loop = loop
        self.logprobs: list = []  # one `TokenLogprob` per delivered token when `logprobs` was asked for
        self._q: asyncio.Queue | queue.SimpleQueue = asyncio.Queue() if loop else queue.SimpleQueue()
        self.cancel_reason: str | None = None  # the finish reason it was cut with: "cancelled" or "stop"
        self.result: Result | None = None
        self.error: BaseException | None = None
        self.clock = clock
        self.submitted = clock()
        self.first_token_at: float | None = None

    def cancel(self, reason: str = "cancelled") -> None:
        """End the generation at the next step with finish reason `reason` (the first reason given holds)."""
        self.cancel_reason = self.cancel_reason or reason

    def stop(self) -> None:
        """A stop sequence matched: the request ended normally (finish reason "stop"), not cancelled."""
        self.cancel("stop")

    @property
    def cancelled(self) -> bool:
        return self.cancel_reason is not None

    # called from the scheduler thread
    def _put(self, item) -> None:
        if self.loop is None:
            self._q.put(item)
        elif not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._q.put_nowait, item)

    def _deliver(self, tokens: list[int], logprobs: list) -> None:
        if self.first_token_at is None:
            self.first_token_at = self.clock()
        self.logprobs.extend(logprobs)  # before the tokens are queued: a consumer sees both together
        self._put(tokens)

    def _finish(self, result: Result | None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self._put(_DONE)

    # consumers
    def __iter__(self):
        while (item := self._q.get()) is not _DONE:
            yield item
        if self.error is not None:
            raise self.error

    async def __aiter__(self):
        while (item := await self._q.get()) is not _DONE:
            yield item
        if self.error is not None:
            raise self.error

    def wait(self) -> Result:
        for _ in self:
            pass
        return self.result


@dataclass
class _Slot:
    index: int
    drafter: object
    state: object
    control: AdaptiveDepth | None
    handle: Handle | None = None  # set under the scheduler's lock when a request claims the slot
    seq: Sequence | None = None
    prefill: deque[Pass] = field(default_factory=deque)  # prompt chunks not run yet (empty: decoding)
    prefill_seconds: float = 0.0
    window_rows: int = 1  # rows of this slot's last drafted window (what the next one may cost)

    @property
    def decoding(self) -> bool:
        return self.seq is not None and not self.prefill


class Scheduler:
    """Continuous batching over a `Generator` built with `slots` KV slots (its drafter settings are the
    server's); `submit` from any thread, results through the returned `Handle`. Pass costs, request times
    and every sequence's stage seconds are read from the generator's clock (`Generator.clock`,
    runtime/clock.py), the one its sequences use, so what the pass plan and adaptive depth decide from is
    measured alike."""

    def __init__(self, gen: Generator, max_waiting: int = 64, metrics: Metrics | None = None,
                 max_slots: int | None = None):
        """`max_slots`: use only that many of the generator's KV slots (batch-1 serving: 1)."""
        if gen.slots < 1:
            raise SpecrtError("the scheduler needs at least one KV slot")
        self.gen, self.max_waiting, self.clock = gen, max_waiting, gen.clock
        self.metrics = metrics or Metrics()
        self.drafter_name = gen.drafter_label
        self.metrics.exactness(gen.lossless, gen.exactness.mode.name, gen.exactness.lossless)
        self.slots = [self._new_slot(i) for i in range(min(gen.slots, max_slots or gen.slots))]
        self.waiting: deque[Handle] = deque()
        self._lock = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        # sequences per verify pass, the latest BATCH_HISTORY (for the bench and tests; bounded: a server
        # runs for days — the metrics' histogram keeps the whole story)
        self.batch_sizes: deque[int] = deque(maxlen=BATCH_HISTORY)
        self.batch_windows = backend_entry(gen.backend).batch_windows
        self.costs, self.yields = pass_policy.PassCosts(), pass_policy.Yield()
        self.plans = {"batched": 0, "drafted": 0, "windows": 0}  # steps of each plan (pass_policy.py)

    def _new_slot(self, i: int) -> _Slot:
        """KV slot i: slot 0 takes the generator's own drafter and target state (those `generate` uses in
        slot 0), the others fresh ones configured the same; each its own adaptive-depth controller."""
        gen = self.gen
        drafter = gen.drafter if i == 0 else gen.fresh_drafter()
        drafter.share(gen.drafter)  # one server-wide memory of earlier sequences (suffix's store)
        return _Slot(i, drafter, gen.state if i == 0 else gen.new_state(), gen.new_control())

    # ── public ──────────────────────────────────────────────────────────────────────────────
    def start(self) -> Scheduler:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specrt-scheduler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def submit(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
               loop: asyncio.AbstractEventLoop | None = None, options: dict | None = None) -> Handle:
        """Queue a request; raises SchedulerFull when every slot is busy and `max_waiting` are waiting.
        `options`: more `Generator.sequence` arguments (`logit_bias`, `logprobs`)."""
        check_prompt(prompt_ids, self.gen.capacity)  # refused now, not after queueing
        handle = Handle(list(prompt_ids), int(max_new_tokens), sampling or SamplingParams(), loop, options,
                        self.clock)
        with self._lock:
            if self._stop:
                raise SchedulerFull("the scheduler is shutting down")
            if len(self.waiting) >= self.max_waiting + len(self._free_slots()):
                self.metrics.rejected.inc()
                raise SchedulerFull(f"all {len(self.slots)} slots are busy and {len(self.waiting)} requests are "
                                 "waiting: retry later")
            self.waiting.append(handle)
            self.metrics.waiting.set(len(self.waiting))
            self._lock.notify_all()
        return handle

    @property
    def alive(self) -> bool:
        """Is the scheduler's thread running (started and neither stopped nor crashed)?"""
        return self._thread is not None and self._thread.is_alive()

    @property
    def running(self) -> int:
        """Sequences holding a KV slot (prefilling or decoding)."""
        return sum(s.handle is not None for s in self.slots)

    # ── the loop ────────────────────────────────────────────────────────────────────────────
    def _free_slots(self) -> list[_Slot]:
        """Slots no request has claimed (call with the lock held)."""
        return [s for s in self.slots if s.handle is None]

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self.waiting and not self.running:
                    self._lock.wait(timeout=1.0)
                if self._stop:
                    break
                admit = []
                for slot in self._free_slots():
                    if not self.waiting:
                        break
                    slot.handle = self.waiting.popleft()  # claimed before the lock is let go
                    admit.append(slot)
                self.metrics.waiting.set(len(self.waiting))
            for slot in admit:
                self._admit(slot)
            self._drop_cancelled()
            self._prefill_chunk()
            if any(s.decoding for s in self.slots):
                self._step()
        for slot in self.slots:  # shutting down: nothing is left hanging
            if slot.seq is not None:
                slot.seq.cancel("abort")
                self._release(slot)
        with self._lock:
            while self.waiting:
                self.waiting.popleft()._finish(None, SchedulerFull("the scheduler shut down"))

    def _admit(self, slot: _Slot) -> None:
        """A claimed slot's new sequence, its prompt queued as prefill chunks (run one per step)."""
        handle = slot.handle
        if handle.cancelled:  # went away after leaving the queue, before its sequence began
            self._unclaim(slot)
            self._dropped(handle)
            return
        try:
            self._choose_drafter(slot)
            if slot.control is not None:
                slot.control.begin()
            slot.seq = self.gen.sequence(handle.prompt_ids, handle.max_new_tokens, handle.sampling, slot.index,
                                         slot.drafter, slot.state, slot.control, max_nodes=WINDOW_MARGIN - 2,
                                         **handle.options)
            slot.prefill, slot.prefill_seconds = deque(slot.seq.prefill_passes()), 0.0
            slot.window_rows = self.gen.max_depth + 1
            self.yields.forget(slot.index)
            self.metrics.running.set(self.running)
        except Exception as e:  # this request fails; the scheduler goes on
            self._fail([slot], e)

    def _choose_drafter(self, slot: _Slot) -> None:
        """`--drafter auto`: the drafter this request runs in `slot`, chosen by measured pay-off
        (runtime/payoff.py), with its adaptive controller; a named drafter keeps the slot's own."""
        if self.gen.choice is not None:
            slot.drafter, slot.control = self.gen.served_drafter(slot.index)

    def _prefill_chunk(self) -> None:
        """One prompt chunk of the sequence that was admitted first among those still prefilling; after
        its last chunk, the first token."""
        waiting = [s for s in self.slots if s.seq is not None and s.prefill]
        if not waiting:
            return
        slot = min(waiting, key=lambda s: s.handle.submitted)
        p = slot.prefill.popleft()
        try:
            t0 = self.clock()
            outs = self._pass([p], slot.index, slot.index + 1)
            slot.seq.absorb(p, outs)
            slot.prefill_seconds += self.clock() - t0
            if slot.prefill:
                return
            first = slot.seq.prefilled(outs["logits"][0], slot.prefill_seconds)
            self.metrics.prompt_tokens.inc(len(slot.handle.prompt_ids))
            self.metrics.time_to_first_token.observe(self.clock() - slot.handle.submitted)
            self._deliver(slot, first)
        except Exception as e:
            self._fail([slot], e)

    def _drop_cancelled(self) -> None:
        """End cancelled or stopped sequences (their slots are free for the next admission), and drop
        cancelled requests still queued."""
        for slot in self.slots:
            if slot.seq is not None and slot.handle.cancelled:
                reason = slot.handle.cancel_reason
                slot.seq.cancel(reason)
                if reason == "cancelled":
                    self.metrics.cancelled.inc()
                self._release(slot)
        with self._lock:
            gone = [h for h in self.waiting if h.cancelled]
            for handle in gone:
                self.waiting.remove(handle)
            if gone:
                self.metrics.waiting.set(len(self.waiting))
        for handle in gone:
            self._dropped(handle)

    def _dropped(self, handle: Handle) -> None:
        """A request that ended before its sequence began: counted, and its consumer told."""
        if handle.cancel_reason == "cancelled":
            self.metrics.cancelled.inc()
        self.metrics.finished(handle.cancel_reason, self.clock() - handle.submitted)
        handle._finish(None, None)

    def _step(self) -> None:
        live = [s for s in self.slots if s.decoding]
        if len(live) < 2:
            self._run_step(live)
            return
        if all(getattr(s.drafter, "name", "") == "plain" for s in live):
            plan = "batched"
        else:
            batch = live[-1].index - live[0].index + 1
            plan = pass_policy.choose([s.index for s in live], batch, {s.index: s.window_rows for s in live},
                                      self.costs, self.yields, self.batch_windows)
        self.plans[plan] += 1
        if plan == "batched":
            self._run_step(live, depth_cap=0)
        elif plan == "windows":
            self._run_step(live)
        else:  # drafted: each slot's own batch-1 pass
            for slot in live:
                if slot.decoding:
                    self._run_step([slot])

    def _run_step(self, live: list[_Slot], depth_cap: int | None = None) -> None:
        """One target pass over the decoding slots `live` (each drafting at most `depth_cap` deep)."""
        plans: dict[int, Pass] = {}
        for slot in live:
            try:
                p = slot.seq.plan(depth_cap)
            except Exception as e:  # this sequence's drafter failed; the others go on
                self._fail([slot], e)
                continue
            if p is None:
                self._release(slot)
            else:
                plans[slot.index] = p
        if not plans:
            return
        lo, hi = min(plans), max(plans) + 1
        batch = [plans.get(b, self._idle_pass(self.slots[b])) for b in range(lo, hi)]
        t0 = self.clock()
        try:
            outs = self._pass(batch, lo, hi)
        except Exception as e:
            self._fail([self.slots[b] for b in plans], e)
            return
        seconds = self.clock() - t0
        self.steps += 1
        self.batch_sizes.append(len(plans))
        self.metrics.step_seconds.observe(seconds)
        self.metrics.batch_size.observe(len(plans))
        self.costs.observe(hi - lo, max(len(p.window) for p in plans.values()), seconds)
        for b, p in plans.items():
            slot = self.slots[b]
            i = b - lo
            try:
                before = slot.seq.stats.accepted
                new = slot.seq.commit(p, outs["logits"][i, : len(p.window)], {k: v[i : i + 1] for k, v in outs.items()},
                                      seconds)
                accepted = slot.seq.stats.accepted - before
                self.metrics.on_step(len(p.proposal), accepted)
                if not p.capped:
                    slot.window_rows = len(p.window)
                    self.yields.observe(b, accepted + 1)
                self._deliver(slot, new)
            except Exception as e:
                self._fail([slot], e)

    @staticmethod
    def _idle_pass(slot: _Slot) -> Pass | None:
        """What a slot in a batched pass's range without a plan of its own runs. A free slot: nothing
        (pack_windows writes a dummy row at its row 0). A slot between two prefill chunks: one dummy row
        where its next chunk starts, which that chunk overwrites — row 0 holds its prompt's first row."""
        if not slot.prefill:
            return None
        return Pass(np.zeros(1, np.int64), slot.prefill[0].past, Tree.chain(0), np.zeros(1, np.int64))

    def _pass(self, plans: list[Pass | None], lo: int, hi: int) -> dict[str, np.ndarray]:
        """One target pass over KV slots lo..hi-1 (`None` plans: idle slots in the range)."""
        self.gen.target.select(lo, hi)
        return self.gen.target.run_all(*pack_windows(plans))

    # ── delivery ────────────────────────────────────────────────────────────────────────────
    def _deliver(self, slot: _Slot, tokens: list[int]) -> None:
        if tokens:
            slot.handle._deliver(tokens, slot.seq.logprobs[len(slot.handle.logprobs):])
            self.metrics.generation_tokens.inc(len(tokens))
        if slot.seq.done:
            self._release(slot)

    def _unclaim(self, slot: _Slot) -> Handle | None:
        """Free the slot for the next admission; its handle."""
        handle = slot.handle
        with self._lock:
            slot.seq = slot.handle = None
            slot.prefill.clear()
            self._lock.notify_all()
        self.metrics.running.set(self.running)
        return handle

    def _release(self, slot: _Slot) -> None:
        seq = slot.seq
        slot.drafter.finish(seq.tokens)  # what every slot's drafter may draft from next (suffix's store)
        handle = self._unclaim(slot)
        result = seq.result()
        self.metrics.finished(result.finish_reason, self.clock() - handle.submitted)
        handle._finish(result)

    def _fail(self, slots: list[_Slot], error: BaseException) -> None:
        for slot in slots:
            handle = self._unclaim(slot)
            self.metrics.errors.inc()
            if handle is not None:
                handle._finish(None, error)
