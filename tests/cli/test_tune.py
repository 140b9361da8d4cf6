"""`specrt tune`: measures candidates against plain, stores the winner, and `generate` then uses it."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from specrt.cli import cli
from specrt.schema.manifest import Manifest
from specrt.tools.tune import Candidate, candidates


@pytest.fixture()
def bundle_copy(tiny_bundle, tmp_path):
    out = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, out)
    return out


@pytest.fixture()
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "one two three one two three one two"}, {"prompt": "a b c a b c a b c a"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_tune_writes_the_measured_best_and_generate_uses_it(bundle_copy, prompts):
    result = CliRunner().invoke(cli, ["tune", str(bundle_copy), "--prompts", str(prompts), "--drafters", "ngram,draft",
                                      "--max-new-tokens", "12", "--raw"])
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith(("ngram", "draft"))]
    assert len(lines) == len(candidates(["ngram", "draft"]))
    assert all(ln.endswith("True") for ln in lines)  # every candidate reproduced plain greedy
    chosen = Manifest.load(bundle_copy).runtime_defaults
    assert chosen["drafter"] in ("ngram", "draft", "plain")
    assert chosen["tuned"]["prompts"] == 2 and chosen["tuned"]["max_new_tokens"] == 12
    best = [ln for ln in result.output.splitlines() if ln.startswith("best:")][0]
    assert chosen["drafter"] in best

    gen = CliRunner().invoke(cli, ["generate", str(bundle_copy), "--prompt", "a b c a b c", "--raw", "--json",
                                   "--max-new-tokens", "8"])
    assert gen.exit_code == 0, gen.output
    assert json.loads(gen.output)["drafter"] == chosen["drafter"]
    explicit = CliRunner().invoke(cli, ["generate", str(bundle_copy), "--prompt", "a b c", "--raw", "--json",
                                        "--max-new-tokens", "4", "--drafter", "plain"])
    assert json.loads(explicit.output)["drafter"] == "plain"


def test_dry_run_leaves_the_manifest_alone(bundle_copy, prompts):
    before = (bundle_copy / "manifest.json").read_text()
    result = CliRunner().invoke(cli, ["tune", str(bundle_copy), "--prompts", str(prompts), "--drafters", "ngram",
                                      "--max-new-tokens", "8", "--raw", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert (bundle_copy / "manifest.json").read_text() == before


def test_unknown_drafter_is_named(bundle_copy, prompts):
    result = CliRunner().invoke(cli, ["tune", str(bundle_copy), "--prompts", str(prompts), "--drafters", "warp"])
    assert result.exit_code != 0 and "warp" in str(result.exception or result.output)


def test_candidates_cover_depths_and_adaptive():
    got = candidates(["plain", "ngram", "eagle3", "medusa"])
    assert Candidate("ngram", 2) in got and Candidate("ngram", 6, adaptive=True) in got
    assert any(c.drafter == "eagle3" and c.tree_nodes for c in got)
    # from one drafted row up: the shortest drafts are the fastest where a row costs much (docs/performance.md)
    assert Candidate("ngram", 1) in got and Candidate("eagle3", 1, tree_nodes=1, beam=1) in got
    assert max(c.tree_nodes or 0 for c in got if c.drafter == "eagle3") == 10
    assert Candidate("eagle3", 1, fan=2) in got and Candidate("eagle3", 2, fan=2) in got  # fans of the first step
    assert not any(c.fan for c in got if c.drafter != "eagle3")
    assert Candidate("medusa") in got  # its exported tree
    assert all(c.drafter != "plain" for c in got)


def test_prompts_are_spread_over_categories():
    from specrt.cli.tune_cmd import spread
    from specrt.tools.bench import Prompt

    prompts = [Prompt(f"{c}{i}", c, "x") for c in ("code", "chat", "maths") for i in range(3)]
    assert [p.id for p in spread(prompts, 4)] == ["code0", "chat0", "maths0", "code1"]
    assert len(spread(prompts, 50)) == 9
