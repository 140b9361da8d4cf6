"""EAGLE-2/3's dynamic tree near the end of the KV capacity: the feature layer's scratch rows (beam
nodes per expanded depth, all of a static tree's nodes) must fit after the last committed row, so
generation ends with finish reason `length`, as plain decoding does, instead of exceeding the
drafter's KV capacity. Random-weight drafters on a tiny target, as tests/runtime/test_learned_drafters.py."""

from __future__ import annotations

import pytest

from specrt.runtime.drafters import features
from specrt.runtime.generate import Generator

CAPACITY, PROMPT = 40, list(range(100, 130))


@pytest.fixture(scope="module")
def eagle_bundle(random_drafters_bundle):
    """A tiny random target with random EAGLE and EAGLE-3 drafters (among others)."""
    return random_drafters_bundle[0]


@pytest.fixture
def pass_rows(monkeypatch):
    """(past, rows) of every feature-layer pass."""
    seen: list[tuple[int, int]] = []
    run = features.FeatureLayer.run

    def spy(self, ids, hidden, positions, past, mask, rows):
        seen.append((past, len(ids)))
        return run(self, ids, hidden, positions, past, mask, rows)

    monkeypatch.setattr(features.FeatureLayer, "run", spy)
    return seen


@pytest.mark.parametrize("name,beam,tree", [("eagle2", 16, None), ("eagle3", 32, None), ("eagle", 4, "wide")])
def test_generation_up_to_the_capacity_ends_with_length(eagle_bundle, pass_rows, name, beam, tree):
    plain = Generator(eagle_bundle, "plain", max_seq_len=CAPACITY).generate_ids(PROMPT, 200)
    gen = Generator(eagle_bundle, name, max_seq_len=CAPACITY, num_draft_tokens=6, beam=beam, tree=tree)
    res = gen.generate_ids(PROMPT, 200)
    assert res.finish_reason == "length", name
    assert len(res.token_ids) == CAPACITY + 1 - len(PROMPT)  # every KV row used, then one last token
    assert res.token_ids == plain.token_ids
    assert res.stats.drafted > 0
    # the drafter ran at the last step (committed rows 0..capacity-2; its catch-up feeds row capacity-3) ...
    assert max(past for past, _ in pass_rows) >= CAPACITY - 3
    if name != "eagle":  # ... where the dynamic tree's scratch rows went past the old fixed margin (+64)
        assert max(past + rows for past, rows in pass_rows) > CAPACITY + 64


def test_the_feature_cache_fits_the_worst_case_scratch_rows(eagle_bundle):
    for name, beam, k, tree, want in [("eagle2", 16, 6, None, 16 * 5), ("eagle2", 2, 3, "wide", 12),
                                      ("eagle", 64, 6, "wide", 12), ("eagle3", 20, 8, None, 20 * 7)]:
        gen = Generator(eagle_bundle, name, max_seq_len=CAPACITY, num_draft_tokens=k, beam=beam, tree=tree)
        assert gen.drafter.scratch_rows() == want, (name, beam, k, tree)
        assert gen.drafter.layer.model.capacity == CAPACITY + want
