"""`specrt validate --lossless` on the real bundle: passes for the real rule, fails (exit 1) for a wrong one."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from specrt.cli import cli
from specrt.plugins.rejection_sample import sample_from
from specrt.runtime import acceptance
from specrt.runtime.sampling import warp

ARGS = ["--lossless", "--json", "--samples", "300", "--length", "3", "--top-k", "4", "--tree", "default"]


def run(bundle, *extra):
    result = CliRunner().invoke(cli, ["validate", str(bundle), *ARGS, *extra])
    return result.exit_code, json.loads(result.output.strip().splitlines()[-1])


@pytest.mark.slow
def test_validate_lossless_passes(trained_int4_bundle):
    code, report = run(trained_int4_bundle)
    assert {"statistic", "threshold", "samples", "verdict"} <= set(report)
    assert report["samples"] == 300 and report["drafter"] == "ngram"
    assert report["accepted_drafts"] > 30, report  # the check exercises acceptance, not only the fallback
    assert code == 0 and report["verdict"] == "pass", report


@pytest.mark.slow
def test_validate_lossless_fails_for_a_wrong_rule(trained_int4_bundle, monkeypatch):
    def always_accept_first(w, logits, params, rng):  # a biased rule: takes the first draft unconditionally
        first = [c for c in range(1, len(w.tokens)) if w.tree.parents[c] == 0][:1]
        return first, sample_from(warp(logits[first[0] if first else 0], params), float(rng.random()))

    monkeypatch.setitem(acceptance.ACCEPTANCE, "rejection", always_accept_first)
    # its draws (trained for seconds) are far from the target
    code, report = run(trained_int4_bundle, "--drafter", "draft")
    assert code == 1 and report["verdict"] == "fail", report
    assert np.isfinite(report["threshold"])
