"""A submitted request as its client holds it: iterate (sync or async) for token chunks, `result` once
finished; `cancel()` or `stop()` ends it at the scheduler's next step. The scheduler's thread delivers
into it; any thread (or the event loop it was submitted from) consumes."""

from __future__ import annotations

import asyncio
import queue
import time

from specrt.runtime.clock import Clock
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.stats import Result

_DONE = object()


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
        self.cached_tokens: int | None = None  # prompt tokens whose KV rows came from the prefix cache (None: no cache)

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
