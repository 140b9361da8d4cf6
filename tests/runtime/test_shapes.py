"""The default EAGLE-2/3 shape (runtime/shapes.py): a chain, or a chain fanned at its first step, sized to
the verify cost curve it is given and the head's acceptance by depth and within its k best; on any curve
the output stays plain decoding's."""

from __future__ import annotations

import json

import pytest

from specrt.runtime.costs import CostCurve
from specrt.runtime.generate import Generator
from specrt.runtime.shapes import PRIOR_ACCEPTANCE, acceptance_prior, chain_shape, fan_speedup, speedups

CPU = CostCurve((1, 2, 3, 4, 5, 8, 16), (3.0, 3.2, 3.6, 4.0, 4.6, 6.8, 13.0))  # steep past 4 rows
FLAT = CostCurve((1, 16), (3.0, 3.3))  # a GPU's: 16 rows cost 1.1× one
KNEE = CostCurve((1, 2, 3, 4, 8, 16), (3.0, 3.05, 3.1, 3.5, 6.0, 12.0))  # up to 3 rows about as one
HEAD = {"acceptance_by_depth": [0.42, 0.37, 0.33], "acceptance_top_k": [0.42, 0.55, 0.62, 0.66]}


def test_speedup_is_tokens_per_step_over_the_steps_cost():
    s = speedups(CPU, [0.5, 0.5], draft_pass=0.3)
    assert s[0] == 1.0
    assert s[1] == pytest.approx(1.5 * 3.0 / (3.2 + 0.3))
    assert s[2] == pytest.approx(1.75 * 3.0 / (3.6 + 0.6))


def test_a_steep_curve_gets_a_short_chain_a_flat_one_a_long_chain():
    entry = {"acceptance_by_depth": [0.7]}
    steep, flat = chain_shape(CPU, entry, 0.07, 5), chain_shape(FLAT, entry, 0.07, 5)
    # on CPU: 1.50×, 1.63×, 1.64×, 1.53× plain at depths 1..4; flat: 1.58×, 1.90×, 2.06×, 2.12×, 2.13× at 1..5:
    # each the fewest rows within ROW_MARGIN of its best
    assert (steep.depth, flat.depth) == (2, 3)
    assert (steep.beam, steep.nodes) == (1, 2)
    assert steep.speedup == pytest.approx(speedups(CPU, [0.7] * 5, 0.07 * 3.0)[2], abs=1e-3)
    assert chain_shape(FLAT, entry, 0.07, 3).depth == 3  # never past the depth asked for (-k)


def test_more_rows_are_taken_only_for_more_than_the_margin():
    """A shape of more rows wins only where it predicts more than ROW_MARGIN over the best of fewer: a noisy
    curve's low reading at 3 rows must not turn a chain of one into a chain of two."""
    from specrt.runtime.shapes import ROW_MARGIN

    entry = {"acceptance_by_depth": [0.4, 0.4]}
    for t3, depth in ((3.245, 1), (3.095, 2)):  # a chain of 2 predicted 3 %, then 8 % over a chain of 1
        curve = CostCurve((1, 2, 3, 8), (3.0, 3.0, t3, 6.0))
        s = speedups(curve, [0.4, 0.4], 0.0)
        assert (s[2] > s[1] * (1 + ROW_MARGIN)) == (depth == 2), s
        assert chain_shape(curve, entry, 0.0, 2).depth == depth, s


def test_a_head_that_does_not_pay_still_drafts_one_and_says_so():
    shape = chain_shape(CPU, {"acceptance_by_depth": [0.05]}, 0.07, 5)
    assert shape.depth == 1 and shape.speedup < 1
    line = shape.describe("eagle3", CPU)
    assert "a chain of 1 draft," in line and "below 1: --drafter auto" in line and "\n" not in line
    assert "0.05" in line and "held-out" in line


def test_a_fan_is_priced_by_its_rows_and_the_heads_top_k():
    """τ(w, d) = 1 + A_w + a_1·(a_2 + a_2·a_3 …) over a pass of w + d rows and d draft passes."""
    assert fan_speedup(CPU, [0.4], 0.55, 2, 0.2) == pytest.approx(1.55 * 3.0 / (3.6 + 0.2))
    assert fan_speedup(CPU, [0.4, 0.5], 0.55, 2, 0.2) == pytest.approx((1.55 + 0.4 * 0.5) * 3.0 / (4.0 + 0.4))
    assert fan_speedup(CPU, [0.4, 0.5], 0.4, 1, 0.2) == pytest.approx(speedups(CPU, [0.4, 0.5], 0.2)[2])


def test_a_flat_knee_gets_a_fan_a_steep_one_a_chain():
    knee, steep = chain_shape(KNEE, HEAD, 0.07, 5), chain_shape(CPU, HEAD, 0.07, 5)
    assert (knee.width, knee.depth, knee.nodes) == (2, 1, 2)  # 3 rows for 1.55 tokens a step
    assert (steep.width, steep.depth) == (1, 1)  # on CPU 3 rows cost 1.2× one: the fan does not repay them
    every = {(w, d): fan_speedup(KNEE, HEAD["acceptance_by_depth"][:d] + [0.33] * (d - 3), HEAD["acceptance_top_k"][w - 1],
                                 w, 0.07 * 3.0) for w in (1, 2, 3, 4) for d in (1, 2, 3, 4, 5)}
    assert knee.speedup == pytest.approx(max(every.values()), abs=1e-3)
    line = knee.describe("eagle3", KNEE)
    assert "a fan of the 2 best first drafts (held-out 0.55 within them) and a chain of 1 draft" in line
    assert knee.to_dict()["width"] == 2 and knee.to_dict()["acceptance_within_width"] == 0.55


@pytest.mark.parametrize("entry", [{"acceptance_by_depth": [0.42, 0.37]}, {"acceptance_top_k": [0.4, 0.9]}],
                         ids=["no top-k counted", "no training record"])
def test_without_the_heads_top_k_the_shape_is_a_chain(entry):
    assert chain_shape(KNEE, entry, 0.07, 5).width == 1


@pytest.mark.parametrize("entry,want,source", [
    ({"acceptance_by_depth": [0.4, 0.3]}, (0.4, 0.3, 0.3), "held-out, at training"),
    ({"acceptance_by_depth": [0.4, 0.3], "acceptance_measured": "run time"}, (0.4, 0.3, 0.3), "held-out, at run time"),
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
    final = {"top1_per_step": [0.43, 0.344], "first_step_top_k": [0.43, 0.55, 0.6, 0.62]}
    (tmp_path / "metrics.json").write_text(json.dumps({"final": final}))
    assert trained_acceptance(str(tmp_path)) == {"acceptance_by_depth": [0.43, 0.344],
                                                 "acceptance_top_k": [0.43, 0.55, 0.6, 0.62]}
    # measured as the run time drafts (scripts/runtime_acceptance.py): ahead of training's; an invalid one is not
    run_time = {"acceptance_by_depth": [0.39, 0.37], "acceptance_top_k": [0.39, 0.53]}
    (tmp_path / "metrics.json").write_text(json.dumps({"final": final, "run_time": run_time}))
    assert trained_acceptance(str(tmp_path)) == {**run_time, "acceptance_measured": "run time"}
    (tmp_path / "metrics.json").write_text(json.dumps({"final": final, "run_time": {"acceptance_by_depth": [2]}}))
    assert trained_acceptance(str(tmp_path))["acceptance_by_depth"] == [0.43, 0.344]
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


@pytest.fixture(scope="module")
def fanned_bundle(eagle_bundle, tmp_path_factory):
    """The random-drafter bundle with a training record of top-k agreement in its eagle3 entry."""
    import shutil

    bundle = tmp_path_factory.mktemp("fanned") / "bundle"
    shutil.copytree(eagle_bundle, bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["drafters"]["eagle3"].update(HEAD)
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    return bundle


def test_the_generator_runs_a_fan_and_stays_plain_decoding(fanned_bundle):
    prompt = list(range(40, 60))
    plain = Generator(fanned_bundle, "plain", max_seq_len=128).generate_ids(prompt, 24).token_ids
    gen = Generator(fanned_bundle, "eagle3", max_seq_len=128, num_draft_tokens=4, costs=KNEE)
    assert (gen.drafter.fan, gen.drafter.depth, gen.drafter.tree_nodes) == (2, 1, 2)
    assert any(n.startswith("note: eagle3: a fan of the 2 best first drafts") for n in gen.notes), gen.notes
    res = gen.generate_ids(prompt, 24)
    assert res.token_ids == plain and res.stats.drafted > 0


@pytest.mark.parametrize("width,depth", [(2, 1), (3, 3), (4, 2)])
def test_a_fan_proposes_the_first_steps_best_then_a_chain_below_the_best(fanned_bundle, width, depth):
    """Slots 1..w: the first step's w best draft tokens, best first; slot w+1 on: the chain under slot 1,
    the tokens a chain of `depth` drafts proposes from the same state."""
    prompt = list(range(40, 60))
    gen = Generator(fanned_bundle, "eagle3", max_seq_len=128, costs=KNEE)
    drafter, propose, seen = gen.drafter, gen.drafter.propose, []
    drafter.fan, drafter.depth, drafter.tree_nodes = width, depth, width + depth - 1

    def both(tokens, max_nodes, max_depth, sampling, rng):
        fan = propose(tokens, max_nodes, max_depth, sampling, rng)
        drafter.fan, drafter.tree_nodes = 1, depth
        chain = propose(tokens, max_nodes, max_depth, sampling, rng)
        drafter.fan, drafter.tree_nodes = width, width + depth - 1
        if max_nodes >= width + depth - 1 and max_depth >= depth:
            seen.append((fan, chain))
        return fan

    drafter.propose = both
    gen.generate_ids(prompt, 24)
    assert seen
    for fan, chain in seen:
        below = [1, *range(width + 1, width + depth - 1)] if depth > 1 else []
        assert fan.parents == [0] * width + below
        assert fan.tokens[0] == chain.tokens[0] and fan.tokens[width:] == chain.tokens[1:]
        assert len(set(fan.tokens[:width])) == width


def test_a_fan_for_a_static_tree_is_refused_by_the_drafter_too(eagle_bundle):
    from specrt.errors import SpecrtError

    with pytest.raises(SpecrtError, match="eagle drafts a static tree"):
        Generator(eagle_bundle, "eagle", max_seq_len=128, costs=CPU, fan=2)


def test_a_fan_is_forced_by_its_option_whatever_the_curve(eagle_bundle):
    """`fan=W` (`--fan`): W first drafts and a chain of -k, on a curve that would choose a plain chain."""
    prompt = list(range(40, 60))
    plain = Generator(eagle_bundle, "plain", max_seq_len=128).generate_ids(prompt, 24).token_ids
    gen = Generator(eagle_bundle, "eagle3", max_seq_len=128, num_draft_tokens=2, costs=CPU, fan=3)
    assert gen.drafter.chosen is None and (gen.drafter.fan, gen.drafter.depth, gen.drafter.tree_nodes) == (3, 2, 4)
    assert gen.generate_ids(prompt, 24).token_ids == plain


@pytest.mark.parametrize("args,says", [
    (["--drafter", "ngram", "--fan", "2"], "drafter ngram has no such step"),
    (["--drafter", "eagle3", "--fan", "2", "--beam", "2"], "was given --beam / --tree-nodes"),
    (["--drafter", "eagle", "--fan", "2"], "drafter eagle has no such step"),
])
def test_a_fan_where_it_cannot_apply_is_refused_in_one_line(eagle_bundle, args, says):
    from click.testing import CliRunner

    from specrt.cli import cli
    from specrt.errors import SpecrtError

    result = CliRunner().invoke(cli, ["generate", str(eagle_bundle), "--prompt", "hi", "--max-new-tokens", "4", *args])
    assert isinstance(result.exception, SpecrtError), result.output
    assert says in str(result.exception) and "\n" not in str(result.exception)


def test_a_tuned_fan_is_the_bundles_default_and_an_option_overrides_it(fanned_bundle, tmp_path):
    """`specrt tune` saves the fan it measured best; a command with no drafter named runs it."""
    import shutil

    from specrt.cli.options import make_generator

    bundle = tmp_path / "tuned"
    shutil.copytree(fanned_bundle, bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["runtime_defaults"] = {"drafter": "eagle3", "num_draft_tokens": 2, "fan": 3}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    common = {"max_seq_len": 128, "threads": 1, "num_draft_tokens": None, "tree": None, "acceptance": None,
              "ngram_max": 3, "ngram_min": 1}
    tuned = make_generator(bundle, None, **common)
    assert (tuned.drafter_name, tuned.drafter.fan, tuned.drafter.depth) == ("eagle3", 3, 2)
    assert make_generator(bundle, None, **common, fan=2).drafter.fan == 2


def test_a_benchmark_takes_a_fan_when_one_of_its_drafters_has_a_first_step_to_widen(eagle_bundle):
    from click.testing import CliRunner

    from specrt.cli import cli
    from specrt.errors import SpecrtError

    base = ["bench", str(eagle_bundle), "--max-new-tokens", "4", "--repeats", "1", "--per-category", "1", "--fan", "2"]
    refused = CliRunner().invoke(cli, [*base, "--drafters", "plain,ngram"])
    assert isinstance(refused.exception, SpecrtError) and "drafter plain, ngram has no such step" in str(refused.exception)
    ran = CliRunner().invoke(cli, [*base, "--drafters", "plain,eagle3"])
    assert ran.exit_code == 0, ran.output


def test_a_small_dynamic_tree_expands_no_deeper_than_its_node_budget(eagle_bundle):
    """Every kept node's ancestors are kept, so a tree of n nodes has none below depth n: expanding deeper
    only costs draft passes. With 2 nodes (-k 5): the catch-up pass and one more a step, at most."""
    prompt = list(range(40, 60))
    plain = Generator(eagle_bundle, "plain", max_seq_len=128).generate_ids(prompt, 24).token_ids
    gen = Generator(eagle_bundle, "eagle3", max_seq_len=128, num_draft_tokens=5, costs=None, tree_nodes=2, beam=2)
    res = gen.generate_ids(prompt, 24)
    assert res.token_ids == plain and res.stats.drafted > 0
    catch_up = 1 if gen.drafter.layer.backend == "native" else 2  # ONNX Runtime: a fuse call, then the pass
    assert res.stats.draft_calls <= res.stats.steps * (catch_up + 1)
