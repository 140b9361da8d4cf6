"""Acceptance rules in the runtime: seeds, temperature 0, and the lossy typical rule named as such."""

from __future__ import annotations

import pytest

from specrt.errors import SpecrtError
from specrt.runtime.acceptance import LOSSY, acceptance_for
from specrt.runtime.generate import Generator
from specrt.runtime.sampling import SamplingParams


def test_rule_choice():
    assert acceptance_for(None, SamplingParams())[0] == "greedy"
    assert acceptance_for("auto", SamplingParams(temperature=0.5))[0] == "rejection"
    assert acceptance_for("rejection", SamplingParams())[0] == "greedy"
    assert LOSSY == {"typical"}
    with pytest.raises(SpecrtError, match="typical needs --temperature > 0"):
        acceptance_for("typical", SamplingParams())
    with pytest.raises(SpecrtError, match="unknown acceptance"):
        acceptance_for("nope", SamplingParams())


def test_same_seed_same_output_and_seeds_differ(tiny_bundle):
    gen = Generator(tiny_bundle, drafter="draft", tree="binary", max_seq_len=64)
    params = SamplingParams(temperature=1.0, seed=11)
    a = gen.generate_ids([3, 4, 5, 3, 4], 20, params).token_ids
    assert gen.generate_ids([3, 4, 5, 3, 4], 20, params).token_ids == a
    others = {tuple(gen.generate_ids([3, 4, 5, 3, 4], 20, SamplingParams(temperature=1.0, seed=s)).token_ids)
              for s in range(4)}
    assert len(others) > 1


def test_typical_acceptance_is_marked_lossy(tiny_bundle):
    gen = Generator(tiny_bundle, drafter="ngram", tree="default", acceptance="typical", max_seq_len=64)
    res = gen.generate_ids([3, 4, 5, 3, 4, 5, 3], 16, SamplingParams(temperature=0.8, seed=0))
    assert res.lossy and len(res.token_ids) == 16
    assert not Generator(tiny_bundle, max_seq_len=64).generate_ids([3, 4], 4).lossy


def test_greedy_trees_equal_plain_on_the_tiny_model(tiny_bundle):
    plain = Generator(tiny_bundle, max_seq_len=64).generate_ids([3, 4, 5, 3, 4, 5], 30).token_ids
    for tree in ("default", "wide", "binary"):
        for drafter in ("ngram", "draft"):
            gen = Generator(tiny_bundle, drafter=drafter, tree=tree, max_seq_len=64)
            assert gen.generate_ids([3, 4, 5, 3, 4, 5], 30).token_ids == plain, (drafter, tree)
