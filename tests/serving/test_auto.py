"""`--drafter auto` in the serving scheduler: each admitted request runs the drafter its slot's choice
picks (runtime/payoff.py), and served greedy output still equals single-request plain decoding."""

from __future__ import annotations

from specrt.runtime.generate import Generator
from specrt.serving.scheduler import Scheduler

PROMPTS = [[3, 4, 5, 3, 4, 5, 3, 4, 9], [7, 8, 9, 10, 7, 8, 9], [20, 21, 22, 20, 21], [5, 5, 5, 5],
           [30, 31, 30, 31, 30], [40, 41, 42, 43, 40, 41], [50, 51, 52, 50], [60, 61, 60, 61, 60, 61]]


def test_served_auto_equals_plain_and_reports_each_requests_drafter(tiny_bundle, tiny_reference):
    gen = Generator(tiny_bundle, drafter="auto", max_seq_len=64, num_draft_tokens=4, slots=4)
    scheduler = Scheduler(gen).start()
    try:
        handles = [scheduler.submit(x, 16 + 2 * i) for i, x in enumerate(PROMPTS)]  # 8 requests, 4 slots
        results = [h.wait() for h in handles]
    finally:
        scheduler.stop()
    assert scheduler.drafter_name == "auto"
    for i, (x, r) in enumerate(zip(PROMPTS, results, strict=True)):
        assert r.token_ids == tiny_reference.generate_ids(x, 16 + 2 * i).token_ids, (i, r.drafter)
    used = [r.drafter for r in results]
    choice = gen.pool.choice(gen.auto_tree, serving=True)
    assert choice.requests == len(PROMPTS) and sum(choice.picks.values()) == len(PROMPTS)
    assert set(choice.candidates) <= set(used)  # every candidate explored across the slots
    assert sum(r.stats.drafted for r in results) > 0 and max(scheduler.batch_sizes) > 1
