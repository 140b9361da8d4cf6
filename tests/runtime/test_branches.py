"""Every code path chosen from the machine can be forced (runtime/branches.py), each forced value runs
here whatever the CPU, and the output names the branch that ran. The training and distillation
branches run in tests/export/test_training_precision.py and tests/export/test_distill.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from specrt.cli import cli
from specrt.errors import SpecrtError
from specrt.runtime.branches import BRANCHES, pick
from specrt.runtime.exec_modes import MODES
from specrt.runtime.generate import Generator

DOCS = Path(__file__).resolve().parents[2] / "docs" / "exactness.md"
PROMPT = [3, 4, 5, 3, 4, 5, 3, 4, 9, 12, 3, 4, 5]


@pytest.fixture(autouse=True)
def unforced(monkeypatch):
    """No branch forced by the environment the tests run in."""
    for branch in BRANCHES.values():
        monkeypatch.delenv(branch.env, raising=False)


@pytest.mark.parametrize("name", list(BRANCHES))
def test_option_wins_then_the_variable_then_the_machine(name, monkeypatch):
    branch = BRANCHES[name]
    first, last = branch.values[0], branch.values[-1]
    assert pick(name).value == "auto" and not pick(name).forced
    monkeypatch.setenv(branch.env, "auto")
    assert not pick(name).forced  # auto in the variable: the machine decides
    monkeypatch.setenv(branch.env, first)
    assert (pick(name).value, pick(name).forced_by) == (first, branch.env)
    assert (pick(name, last).value, pick(name, last).forced_by) == (last, "option")
    monkeypatch.setenv(branch.env, "nonsense")
    with pytest.raises(SpecrtError, match=f"{branch.env}='nonsense': choose auto or one of {', '.join(branch.values)}"):
        pick(name)


def test_every_branch_is_in_the_docs_table():
    """docs/exactness.md's "Branches chosen from the machine" names each branch's variable and values."""
    text = DOCS.read_text()
    section = text[text.index("## Branches chosen from the machine"):]
    for branch in BRANCHES.values():
        assert f"`{branch.env}`" in section, branch.env
        for value in branch.values:
            assert f"`{value}`" in section, (branch.name, value)


@pytest.mark.parametrize("mode", list(MODES))
def test_every_exec_mode_runs_here_and_equals_plain(tiny_bundle, mode):
    """Each mode's own passes (direct, padded) on this CPU: greedy speculation equals plain decoding."""
    plain = Generator(tiny_bundle, drafter="plain", max_seq_len=64, exec_mode="direct").generate_ids(PROMPT, 16)
    gen = Generator(tiny_bundle, drafter="ngram", max_seq_len=64, exec_mode=mode, allow_inexact=True)
    assert (gen.exactness.mode.name, gen.exactness.forced_by) == (mode, "option")
    assert getattr(gen.target, "mode", MODES["direct"]).min_rows == MODES[mode].min_rows  # passes shaped by it
    res = gen.generate_ids(PROMPT, 16)
    assert res.stats.drafted > 0
    assert gen.exactness.lossless, gen.exactness.reason  # a tiny fp32 target is invariant in every mode
    assert res.token_ids == plain.token_ids


def test_the_variable_forces_the_exec_mode_and_json_says_so(tiny_bundle, monkeypatch):
    auto = Generator(tiny_bundle, max_seq_len=64).exactness
    assert auto.forced_by == "" and auto.mode.name == auto.record["chosen"]
    forced = next(m for m in MODES if m != auto.mode.name)
    monkeypatch.setenv("SPECRT_EXEC_MODE", forced)
    gen = Generator(tiny_bundle, max_seq_len=64)  # as tune, validate and Triton build it: auto asked
    assert (gen.exactness.mode.name, gen.exactness.forced_by) == (forced, "SPECRT_EXEC_MODE")
    out = CliRunner().invoke(cli, ["generate", str(tiny_bundle), "--prompt", "hi", "--max-new-tokens", "2", "--json"])
    assert out.exit_code == 0, out.output
    body = json.loads(out.stdout)["exactness"]
    assert (body["mode"], body["forced_by"], body["auto_mode"]) == (forced, "SPECRT_EXEC_MODE", auto.record["chosen"])
    monkeypatch.setenv("SPECRT_EXEC_MODE", "pad3")
    with pytest.raises(SpecrtError, match="SPECRT_EXEC_MODE='pad3'"):
        Generator(tiny_bundle, max_seq_len=64)
