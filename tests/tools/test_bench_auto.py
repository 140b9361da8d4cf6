"""`specrt bench --drafters auto`: every auto row says which drafter its request ran and why."""

from __future__ import annotations

from specrt.runtime.generate import Generator
from specrt.tools.bench import Prompt, format_table, run_bench
from specrt.tools.report import auto_section

PROMPTS = [Prompt("a", "code", "a b c a b c a b c a b"), Prompt("b", "chat", "one two one two one two"),
           Prompt("c", "chat", "red green blue red green")]


def test_bench_reports_the_drafter_each_auto_request_used(tiny_bundle):
    gen = Generator(tiny_bundle, max_seq_len=64, num_draft_tokens=4)
    res = run_bench(gen, PROMPTS, ["auto"], 16, raw=True, progress=False, cooldown=0)
    rows = [r for r in res["rows"] if r["drafter"] == "auto"]
    assert len(rows) == len(PROMPTS) and all(r["identical_to_plain"] for r in rows)
    for r in rows:
        assert r["drafter_used"] == r["auto"]["drafter"] and r["auto"]["reason"] in ("explore", "revisit", "pays", "plain")
        assert set(r["auto"]["speedup"]) == set(gen.choice.candidates)
    assert {r["drafter_used"] for r in rows if r["auto"]["reason"] == "explore"} <= set(gen.choice.candidates)
    used = res["summary"]["auto"]["drafters_used"]
    assert sum(used.values()) == len(PROMPTS) and "drafters_used" not in res["summary"]["plain"]
    assert "auto: requests ran " in format_table(res["summary"])
    section = auto_section(res)
    assert section.count("\n| auto |") == len(PROMPTS) and all(r["drafter_used"] in section for r in rows)
