"""Bench engine specs: NAME+adaptive configs and the --baseline bundle peer."""

from __future__ import annotations

import pytest

from specrt.errors import SpecrtError
from specrt.runtime.generate import Generator
from specrt.tools.bench import Prompt, config_spec, run_bench
from specrt.tools.peers import baseline_peer

PROMPTS = [Prompt("a", "code", "a b c a b c a b c a b"), Prompt("b", "chat", "one two one two one two")]


def test_engine_spec():
    assert config_spec("ngram") == ("ngram", None)
    assert config_spec("eagle3+adaptive") == ("eagle3", True)


def test_adaptive_engine_runs_beside_the_fixed_one(tiny_bundle):
    gen = Generator(tiny_bundle, max_seq_len=64)
    res = run_bench(gen, PROMPTS, ["ngram", "ngram+adaptive"], 16, raw=True, progress=False, cooldown=0)
    rows = {(r["drafter"], r["id"]): r for r in res["rows"]}
    assert set(res["summary"]) == {"plain", "ngram", "ngram+adaptive"}
    for p in PROMPTS:
        adaptive, fixed = rows[("ngram+adaptive", p.id)], rows[("ngram", p.id)]
        assert adaptive["identical_to_plain"] and fixed["identical_to_plain"]
        assert adaptive["mean_draft_depth"] > 0 and fixed["mean_draft_depth"] == 0  # only adaptive records it
        assert 0 <= adaptive["plain_steps"] <= adaptive["steps"]
    assert not gen.adaptive  # the generator's own setting is untouched


def test_baseline_bundle_peer(tiny_bundle):
    peers = baseline_peer(tiny_bundle, threads=2, max_seq_len=64)
    assert list(peers) == ["specrt-fp32-plain"]
    gen = Generator(tiny_bundle, max_seq_len=64)
    res = run_bench(gen, PROMPTS, ["ngram"], 12, peers=peers, raw=True, progress=False, cooldown=0)
    rows = [r for r in res["rows"] if r["drafter"] == "specrt-fp32-plain"]
    assert len(rows) == 2 and all(r["same_as_specrt_plain"] for r in rows)  # same bundle, same output
    assert res["summary"]["plain"]["speedup_vs"]["specrt-fp32-plain"] > 0


def test_baseline_bundle_must_exist(tmp_path):
    with pytest.raises(SpecrtError, match="does not exist"):
        baseline_peer(tmp_path / "missing", threads=1)
