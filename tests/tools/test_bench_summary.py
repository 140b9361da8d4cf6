"""The benchmark's summary: ratios against plain, τ and acceptance by draft depth from the raw rows."""

from __future__ import annotations

from specrt.tools.bench import format_table, summarize


def row(drafter, pid, tps, tau, steps, per_pos, category="code"):
    return {"drafter": drafter, "id": pid, "category": category, "tokens_per_s": tps, "mean_accepted_len": tau,
            "identical_to_plain": True, "steps": steps, "accepted_per_position": per_pos}


def test_summary_reports_speedup_tau_and_acceptance_by_position():
    rows = [row("plain", "a", 10.0, 1.0, 20, []), row("plain", "b", 20.0, 1.0, 20, []),
            row("eagle", "a", 15.0, 1.8, 10, [6, 2]), row("eagle", "b", 20.0, 1.5, 10, [4, 1, 1])]
    s = summarize(rows)
    assert s["eagle"]["speedup_vs_plain"] == 1.25  # median of 1.5 and 1.0
    assert s["eagle"]["mean_accepted_len"] == 1.65
    # depth 1 accepted in 10 of 20 verify steps, depth 2 in 3, depth 3 in 1: τ = 1 + 0.5 + 0.15 + 0.05
    assert s["eagle"]["acceptance_by_position"] == [0.5, 0.15, 0.05]
    assert s["plain"]["acceptance_by_position"] == []
    table = format_table(s)
    assert "0.50 0.15 0.05" in table and table.count("\n") == 2
