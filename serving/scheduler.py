"""The serving scheduler's driver: many requests share each target pass (continuous batching).

The decisions are serving/core.py's (`SchedulerCore.plan` / `.apply`, no threads, clocks or locks);
this driver owns the rest. One thread runs `step()` while there is work:

    admit   under the lock: as many waiting requests as there are free KV slots leave the queue
    plan    core.plan(admitted)             the step's passes, and the requests it already ended
    run     each planned pass on the TargetModel (`runner`), timed by the generator's clock
    apply   core.apply(plan, outputs)       tokens to deliver, requests ended
    deliver into each request's Handle; the metrics

`submit` (any thread) queues a request or refuses it (SchedulerFull): at most `max_waiting` wait beyond
the free slots, counted under the lock from submission to the request's end, so the bound holds under
bursts. Tests call `step()` themselves, or give a `runner` that holds passes until they let them run.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable

from specrt.errors import SpecrtError
from specrt.runtime.batch import BatchOutputs
from specrt.runtime.generate import Generator
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.sequence import PREFILL_CHUNK, check_prompt
from specrt.serving.core import BatchPass, Delivered, Ended, Event, PassOutput, SchedulerCore, StepPlan
from specrt.serving.handle import Handle
from specrt.serving.metrics import Metrics
from specrt.serving.prefix_cache import PrefixCache

Runner = Callable[[BatchPass], BatchOutputs]  # one planned pass's outputs


class SchedulerFull(SpecrtError):
    """Every slot is busy and the waiting queue is full (HTTP 503)."""


class Scheduler:
    """Continuous batching over a `Generator` built with `slots` KV slots (its drafter settings are the
    server's); `submit` from any thread, results through the returned `Handle`. Pass costs, request times
    and every sequence's stage seconds are read from the generator's clock (`Generator.clock`,
    runtime/clock.py), the one its sequences use, so what the pass plan and adaptive depth decide from is
    measured alike."""

    def __init__(self, gen: Generator, max_waiting: int = 64, metrics: Metrics | None = None,
                 max_slots: int | None = None, runner: Runner | None = None, prefix_cache_mb: int = 0,
                 prefill_chunk: int = PREFILL_CHUNK):
        """`max_slots`: use only that many of the generator's KV slots (batch-1 serving: 1); `runner`: what
        runs a planned pass (default: the generator's `TargetModel.run_batch`); `prefix_cache_mb`: the
        prefix cache's size (serving/prefix_cache.py; 0: none); `prefill_chunk`: the prompt rows a step runs
        (SchedulerCore)."""
        if gen.slots < 1:
            raise SpecrtError("the scheduler needs at least one KV slot")
        self.gen, self.max_waiting, self.clock = gen, max_waiting, gen.clock
        self.metrics = metrics or Metrics()
        self.drafter_name = gen.drafter_label
        self.metrics.exactness(gen.lossless, gen.exactness.mode.name, gen.exactness.lossless)
        if prefix_cache_mb and not gen.model.host_kv:
            raise SpecrtError(f"--prefix-cache-mb {prefix_cache_mb}: the {gen.backend} backend's KV cache is not in "
                              "host memory, so its rows cannot be copied: use --prefix-cache-mb 0 there")
        prefix = PrefixCache(prefix_cache_mb << 20) if prefix_cache_mb else None
        self.core = SchedulerCore(gen, min(gen.slots, max_slots or gen.slots), prefix=prefix,
                                  prefill_chunk=prefill_chunk)
        self.prefaulted = gen.model.prefault()  # the KV pages now, not in the first requests' passes
        self.runner: Runner = runner or (lambda bp: gen.model.run_batch(bp.windows, bp.start))
        self.waiting: deque[Handle] = deque()
        self._pending = 0  # requests submitted and not ended (waiting or holding a slot), under the lock
        self._lock = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    # the core's record (for the bench and tests)
    slots = property(lambda self: self.core.slots)
    batch_sizes = property(lambda self: self.core.batch_sizes)
    plans = property(lambda self: self.core.plans)
    steps = property(lambda self: self.core.steps)

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
        else:  # never started (a test stepping it itself): its requests end here
            self._shutdown()

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
            if self._pending >= self.max_waiting + len(self.slots):
                self.metrics.rejected.inc()
                raise SchedulerFull(f"all {len(self.slots)} slots are busy and {len(self.waiting)} requests are "
                                    "waiting: retry later")
            self._pending += 1
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
        """Requests holding a KV slot (prefilling or decoding)."""
        return self.core.running

    def step(self) -> list[Event]:
        """One step: admit, plan, run the passes, apply, deliver; its events (none: nothing to do)."""
        with self._lock:
            admit, gone = [], [h for h in self.waiting if h.cancelled]
            for handle in gone:  # cancelled while queued: never admitted
                self.waiting.remove(handle)
            while self.waiting and len(admit) < self.core.room:
                admit.append(self.waiting.popleft())
            self.metrics.waiting.set(len(self.waiting))
        plan = self.core.plan(admit)
        # the requests that ended before any pass: delivered first
        events = self._deliver([Ended(h, None, h.cancel_reason) for h in gone] + plan.events)
        return events + self._deliver(self.core.apply(plan, self._run_passes(plan)))

    # ── the loop ────────────────────────────────────────────────────────────────────────────
    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self.waiting and not self.running:
                    self._lock.wait(timeout=1.0)
                if self._stop:
                    break
            self.step()
        self._shutdown()

    def _shutdown(self) -> None:
        """Nothing is left hanging: running sequences end ("abort"), waiting requests get SchedulerFull."""
        self._deliver(self.core.abort())
        with self._lock:
            gone, self.waiting = list(self.waiting), deque()
        for handle in gone:
            self._ended(Ended(handle, None, None, SchedulerFull("the scheduler shut down")))

    def _run_passes(self, plan: StepPlan) -> list[PassOutput]:
        outputs = []
        for bp in plan.passes:
            t0 = self.clock()
            try:
                outs = self.runner(bp)
            except Exception as e:  # the pass's requests fail; the scheduler goes on
                outputs.append(PassOutput(None, self.clock() - t0, e))
                continue
            seconds = self.clock() - t0
            outputs.append(PassOutput(outs, seconds))
            if bp.decoding:
                self.metrics.step_seconds.observe(seconds)
                self.metrics.batch_size.observe(len(bp.decoding))
        return outputs

    # ── delivery ────────────────────────────────────────────────────────────────────────────
    def _deliver(self, events: list[Event]) -> list[Event]:
        for event in events:
            if isinstance(event, Delivered):
                handle = event.handle
                if event.first:
                    self.metrics.prompt_tokens.inc(len(handle.prompt_ids))
                    if handle.cached_tokens is not None:
                        self.metrics.prefix_queries.inc(len(handle.prompt_ids))
                        self.metrics.prefix_hits.inc(handle.cached_tokens)
                    self.metrics.time_to_first_token.observe(self.clock() - handle.submitted)
                else:
                    self.metrics.on_step(event.drafted, event.accepted)
                if event.tokens:
                    handle._deliver(event.tokens, event.logprobs)
                    self.metrics.generation_tokens.inc(len(event.tokens))
            else:
                self._ended(event)
        self.metrics.running.set(self.running)
        return events

    def _ended(self, event: Ended) -> None:
        if event.error is not None:
            self.metrics.errors.inc()
        else:
            if event.reason == "cancelled":
                self.metrics.cancelled.inc()
            self.metrics.finished(event.reason, self.clock() - event.handle.submitted)
        with self._lock:
            self._pending -= 1
            self._lock.notify_all()
        event.handle._finish(event.result, event.error)
