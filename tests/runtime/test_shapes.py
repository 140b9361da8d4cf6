"""The default EAGLE-2/3 shape (runtime/shapes.py): a chain sized to the verify cost curve it is given
and the head's acceptance by depth; on any curve the output stays plain decoding's."""

from __future__ import annotations

import json

import pytest

from specrt.runtime.costs import CostCurve
from specrt.runtime.generate import Generator
from specrt.runtime.shapes import PRIOR_ACCEPTANCE, acceptance_prior, chain_shape, speedups

CPU = CostCurve((1, 2, 3, 4, 5, 8, 16), (3.0, 3.2, 3.6, 4.0, 4.6, 6.8, 13.0))  # steep past 4 rows
FLAT = CostCurve((1, 16), (3.0, 3.3))  # a GPU's: 16 rows cost 1.1× one


def test_speedup_is_tokens_per_step_over_the_steps_cost():
    s = speedups(CPU, [0.5, 0.5], draft_pass=0.3)
    assert s[0] == 1.0
    assert s[1] == pytest.approx(1.5 * 3.0 / (3.2 + 0.3))
    assert s[2] == pytest.approx(1.75 * 3.0 / (3.6 + 0.6))


def test_a_steep_curve_gets_a_short_chain_a_flat_one_a_long_chain():
    entry = {"acceptance_by_depth": [0.7]}
    steep, flat = chain_shape(CPU, entry, 0.07, 5), chain_shape(FLAT, entry, 0.07, 5)
    assert (steep.depth, flat.depth) == (3, 5)  # on CPU: 1.50×, 1.63×, 1.64×, 1.53× plain at depths 1..4
    assert (steep.beam, steep.nodes) == (1, 3)
    assert steep.speedup == pytest.approx(speedups(CPU, [0.7] * 5, 0.07 * 3.0)[3], abs=1e-3)
    assert chain_shape(FLAT, entry, 0.07, 3).depth == 3  # never past the depth asked for (-k)


def test_a_head_that_does_not_pay_still_drafts_one_and_says_so():
    shape = chain_shape(CPU, {"acceptance_by_depth": [0.05]}, 0.07, 5)
    assert shape.depth == 1 and shape.speedup < 1
    line = shape.describe("eagle3", CPU)
    assert "a chain of 1 draft," in line and "below 1: --drafter auto" in line and "\n" not in line
    assert "0.05" in line and "held-out" in line


@pytest.mark.parametrize("entry,want,source", [
    ({"acceptance_by_depth": [0.4, 0.3]}, (0.4, 0.3, 0.3), "held-out"),
    ({}, (PRIOR_ACCEPTANCE,) * 3, "prior"),
    ({"acceptance_by_depth": []}, (PRIOR_ACCEPTANCE,) * 3, "prior"),
])
def test_acceptance_comes_from_training_else_a_prior(entry, want, source):
    acc, where = acceptance_prior(entry, 3)
    assert acc == want and source in where


@pytest.fixture(scope="module")
def eagle_bundle(random_drafters_bundle):
    return random_drafters_bundle[0]


@pytest.mark.parametrize("drafter", ["eagle2", "eagle3"])
def test_the_generator_sizes_dynamic_drafters_by_its_curve(eagle_bundle, drafter):
    prompt = list(range(40, 60))
    plain = Generator(eagle_bundle, "plain", max_seq_len=128).generate_ids(prompt, 24).token_ids
    depths = {}
    for name, curve in (("cpu", CPU), ("flat", FLAT)):
        gen = Generator(eagle_bundle, drafter, max_seq_len=128, num_draft_tokens=4, costs=curve)
        depths[name] = gen.drafter.chosen.depth
        assert (gen.drafter.beam, gen.drafter.tree_nodes, gen.drafter.depth) == (1, depths[name], depths[name])
        assert any(n.startswith(f"note: {drafter}: a chain of") for n in gen.notes), gen.notes
        res = gen.generate_ids(prompt, 24)
        assert res.token_ids == plain, name
        assert res.stats.drafted > 0
        assert max(len(res.stats.accepted_per_position), 1) <= depths[name]
    assert depths["cpu"] < depths["flat"]


def test_a_given_shape_or_no_curve_keeps_the_tree(eagle_bundle):
    given = Generator(eagle_bundle, "eagle3", max_seq_len=128, costs=CPU, tree_nodes=6, beam=2)
    assert given.drafter.chosen is None and (given.drafter.beam, given.drafter.tree_nodes) == (2, 6)
    none = Generator(eagle_bundle, "eagle3", max_seq_len=128, costs=None)
    assert none.drafter.chosen is None and (none.drafter.beam, none.drafter.tree_nodes) == (4, 10)
    static = Generator(eagle_bundle, "eagle", max_seq_len=128, costs=CPU)  # EAGLE-1: its static tree
    assert static.drafter.chosen is None


def test_export_records_the_heads_training_acceptance(tmp_path):
    pytest.importorskip("torch")
    from specrt.export.drafter_export import trained_acceptance

    (tmp_path / "metrics.json").write_text(json.dumps({"final": {"top1_per_step": [0.43, 0.344, 0.3117]}}))
    assert trained_acceptance(str(tmp_path)) == {"acceptance_by_depth": [0.43, 0.344, 0.3117]}
    for bad in ({"final": {"top1_per_step": [1.5]}}, {"final": {}}, [1, 2]):
        (tmp_path / "metrics.json").write_text(json.dumps(bad))
        assert trained_acceptance(str(tmp_path)) == {}
    assert trained_acceptance(str(tmp_path / "missing")) == {}


def test_generate_names_the_shape_on_the_console_and_in_json(eagle_bundle, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from specrt.cli import cli

    monkeypatch.setenv("SPECRT_HOME", str(tmp_path))  # this machine's curve, measured into a fresh cache
    base = ["generate", str(eagle_bundle), "--prompt", "hi", "--max-new-tokens", "4", "--drafter", "eagle3"]
    out = CliRunner().invoke(cli, [*base, "--json"])
    assert out.exit_code == 0, out.output
    shape = json.loads(out.stdout)["shape"]
    assert shape["beam"] == 1 and shape["nodes"] == shape["depth"] >= 1 and shape["predicted_speedup"] > 0
    assert f"note: eagle3: a chain of {shape['depth']} draft" in out.stderr
    assert list((tmp_path / "cache" / "costs").glob("*.json"))
    given = CliRunner().invoke(cli, [*base, "--json", "--tree-nodes", "6", "--beam", "2"])
    assert given.exit_code == 0 and "shape" not in json.loads(given.stdout) and "a chain of" not in given.stderr
