"""`specrt validate --quality`: the default int4 target (the GGUF's own blocks) against the fp32 model of the
file's values, teacher-forced on held-out chat, within its bounds; the verdict fails outside them (the
symmetric re-quantized int4 path measured 1.30 and 0.65: docs/quality.md)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from specrt.cli import cli
from specrt.tools.quality import Bounds, verdict


def test_the_default_int4_path_computes_the_model_files_model(trained_int4_bundle):
    r = CliRunner().invoke(cli, ["validate", str(trained_int4_bundle), "--quality", "--json"])
    assert r.exit_code == 0, r.output
    start = r.output.rindex('{"quality"')  # after whatever progress the export tools wrote to stderr
    report = json.JSONDecoder().raw_decode(r.output[start:])[0]["quality"]
    assert report["verdict"] == "pass" and report["positions"] > 300
    assert report["ratio"] <= 1.02 and report["top1_agreement"] >= 0.95 and report["kl"] < 0.02, report
    assert report["reference"].endswith(".gguf")


def test_the_verdict_holds_both_bounds():
    good = {"ratio": 1.005, "top1_agreement": 0.97}
    assert verdict(good, Bounds()) == "pass"
    assert verdict({**good, "ratio": 1.30}, Bounds()) == "fail"
    assert verdict({**good, "top1_agreement": 0.65}, Bounds()) == "fail"
    assert verdict(good, Bounds(max_ratio=1.001)) == "fail"
