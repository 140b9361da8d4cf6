"""Load: 500 requests at concurrency 8 with mixed parameters on a loopback server — no errors, every
greedy response equal to single-request plain generation, memory flat after warm-up."""

from __future__ import annotations

import numpy as np

from specrt.runtime.generate import Generator
from specrt.tools.mixed_load import check, mixed_requests, plain_texts, serve_mixed

PROMPTS = ["The list of colors: red, green, blue, red, green,", "Once upon a time", "1 2 3 4 5 6 7 8",
           "Hello! How are you today?", "def add(a, b):\n    return", "Paris is the capital of"]
REQUESTS, CONCURRENCY, WARMUP = 500, 8, 100


def test_500_mixed_requests_at_concurrency_8(tiny_bundle, tiny_reference):
    gen = Generator(tiny_bundle, drafter="ngram", max_seq_len=64, slots=8)
    reqs = mixed_requests(REQUESTS, PROMPTS, 16, np.random.default_rng(7))
    report, outcomes, scheduler = serve_mixed(gen, reqs, CONCURRENCY, warmup=WARMUP)
    report = check(reqs, outcomes, plain_texts(tiny_reference, reqs), report)
    assert not report.errors, report.errors[:3]
    assert not report.mismatches, report.mismatches[:3]
    assert report.greedy > 250
    assert max(scheduler.batch_sizes) >= 4  # requests really shared verify passes
    print(report.summary())
    growth = report.rss_mb[1] - report.rss_mb[0]
    assert growth < 25, f"memory grew {growth:.1f} MB between request {WARMUP} and {REQUESTS}"
