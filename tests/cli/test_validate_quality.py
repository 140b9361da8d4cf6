"""`specrt validate --quality`: the default int4 target (the GGUF's own blocks) against the fp32 model of the
file's values, teacher-forced on held-out chat, within its bounds; the verdict fails outside them (the
symmetric re-quantized int4 path measured 1.30 and 0.65: docs/quality.md)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from specrt.cli import cli
from specrt.errors import SpecrtError
from specrt.tools.quality import Bounds, quality_check, verdict


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


def test_an_int8_kv_cache_stays_within_the_bounds(trained_int4_bundle, real_model):
    """--kv-dtype int8 rounds every key and value the prefill's attention reads to int8 blocks: measured
    (docs/quality.md) it moves the model less than the bounds allow. (The source model the session already
    loaded is the reference: the CLI's path is the test above.)"""
    report = quality_check(trained_int4_bundle, kv_dtype="int8", source_model=real_model)
    assert report["kv_dtype"] == "int8" and report["backend"] == "native"
    assert report["verdict"] == "pass" and report["kl"] < 0.02, report


def test_a_reference_loaded_from_another_file_is_refused(trained_int4_bundle, tmp_path):
    other = SimpleNamespace(source=str(tmp_path / "other.gguf"))
    with pytest.raises(SpecrtError, match="was exported from .*, not from the model given, .*other.gguf"):
        quality_check(trained_int4_bundle, source_model=other)


def test_a_kv_dtype_without_the_quality_check_is_refused(tmp_path):
    r = CliRunner().invoke(cli, ["validate", str(tmp_path), "--lossless", "--kv-dtype", "int8"])
    assert r.exit_code != 0 and "--kv-dtype applies to --quality only" in str(r.exception)
