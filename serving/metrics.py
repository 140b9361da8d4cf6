"""Prometheus metrics of the server: requests, tokens, speculation counters, latency histograms.

Names follow vLLM's where one exists (`spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`), prefixed `specrt_`. Each server has its
own registry, so several servers (and tests) in one process do not collide.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()  # no `*_created` series: one timestamp per counter is noise to most dashboards

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
MAX_POSITIONS = 16  # accepted-per-position series kept (deeper drafts count in the last one)


class Metrics:
    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specrt_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finish = Counter("specrt_request_finish", "Finished generations by finish reason", ["reason"],
                              registry=r)
        self.rejected = Counter("specrt_rejected", "Requests refused because every slot and the queue were full",
                                registry=r)
        self.cancelled = Counter("specrt_cancelled", "Requests ended because the client went away (generating or "
                                 "still queued); a stop sequence is a normal finish, not a cancellation", registry=r)
        self.errors = Counter("specrt_engine_errors", "Generations that failed inside the engine", registry=r)
        self.prompt_tokens = Counter("specrt_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.prefix_queries = Counter("specrt_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("specrt_prefix_cache_hits", "Prompt tokens whose KV rows the prefix cache gave",
                                   registry=r)
        self.generation_tokens = Counter("specrt_generation_tokens", "Tokens generated", registry=r)
        self.drafts = Counter("specrt_spec_decode_num_drafts", "Verify steps that carried a draft", registry=r)
        self.draft_tokens = Counter("specrt_spec_decode_num_draft_tokens", "Drafted tokens verified", registry=r)
        self.accepted_tokens = Counter("specrt_spec_decode_num_accepted_tokens", "Drafted tokens accepted",
                                       registry=r)
        self.accepted_per_pos = Counter("specrt_spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted drafted tokens by draft position (0 = first drafted)",
                                        ["position"], registry=r)
        self.running = Gauge("specrt_num_requests_running", "Sequences in KV slots", registry=r)
        self.waiting = Gauge("specrt_num_requests_waiting", "Requests queued for a slot", registry=r)
        self.request_latency = Histogram("specrt_e2e_request_latency_seconds", "Submit to last token",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.time_to_first_token = Histogram("specrt_time_to_first_token_seconds", "Submit to first token",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.step_seconds = Histogram("specrt_verify_pass_seconds", "One batched target verify pass",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("specrt_batch_size", "Sequences sharing a verify pass",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)
        self.lossless = Gauge("specrt_lossless", "1 when served output equals plain batch-1 decoding of the "
                              "target (greedy) or follows its distribution (sampling) on this machine", registry=r)
        self.exec_mode = Gauge("specrt_exec_mode_info", "The execution mode target passes run in (value 1)",
                               ["mode", "batch_invariant"], registry=r)

    def exactness(self, lossless: bool, mode: str, batch_invariant: bool) -> None:
        self.lossless.set(1 if lossless else 0)
        self.exec_mode.labels(mode, str(batch_invariant).lower()).set(1)

    def on_step(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.drafts.inc()
            self.draft_tokens.inc(drafted)
        if accepted:
            self.accepted_tokens.inc(accepted)
            for pos in range(accepted):
                self.accepted_per_pos.labels(str(min(pos, MAX_POSITIONS - 1))).inc()

    def finished(self, reason: str, seconds: float) -> None:
        self.finish.labels(reason).inc()
        self.request_latency.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
