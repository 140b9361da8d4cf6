"""Every drafter kind in the registry (specrt/kinds/) has each kind of test it needs:

    proposal   what its runtime drafter proposes equals an independent recomputation (or a worked example)
    export     its graphs' ONNX Runtime outputs equal its PyTorch module (learned kinds)
    lossless   speculative greedy output equals plain greedy output on the real default model
    serving    batched serving through the scheduler equals plain output

A new kind without one of them fails here, naming the kind and the missing aspect.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specrt.kinds import kinds
from tests import kind_coverage

ROOT = Path(__file__).resolve().parents[1]


def needs(spec) -> set[str]:
    if spec.name == "plain":  # proposes nothing; it is the reference the others are held to
        return {"serving"}
    return {"proposal", "lossless", "serving"} | ({"export"} if spec.learned else set())


@pytest.fixture(scope="module")
def coverage(tmp_path_factory):
    whole = kind_coverage.whole_suite_coverage(ROOT)  # this run collected the whole suite: read it
    if whole is not None:
        return whole
    out = tmp_path_factory.mktemp("coverage") / "coverage.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.kind_coverage",
                           "-p", "no:cacheprovider", str(ROOT / "tests")], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "SPECRT_KIND_COVERAGE": str(out)}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind", list(kinds()))
def test_kind_has_every_test_it_needs(coverage, kind):
    missing = sorted(a for a in needs(kinds()[kind]) if kind not in coverage.get(a, []))
    assert not missing, f"drafter kind {kind!r} has no {', '.join(missing)} test: see tests/test_kind_coverage.py"


def test_coverage_reads_markers_and_parameters(coverage):
    assert set(coverage) >= {"proposal", "export", "lossless", "serving"}
    assert "eagle" in coverage["lossless"] and "eagle2" not in coverage["lossless"]  # runtime names map to kinds
