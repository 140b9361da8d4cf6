"""`specrt validate --polygraphy`: a tiny exported bundle passes against its PyTorch reference; a corrupted
graph or reference fails (exit 1) naming the role and output; a bundle without reference files says to re-export."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from specrt.cli import cli
from tests.cli.test_bad_input import assert_one_line_error, specrt
from tests.helpers import save_tiny_folder


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, tokenizer_dir):
    """A 2-layer random Llama (vocab 49152, the real tokenizer) with a 1-layer draft, exported by this code."""
    from specrt.export.bundle import ExportOptions, export_bundle

    folder = save_tiny_folder(tmp_path_factory.mktemp("pg") / "llama", "llama", tokenizer_dir, vocab_size=49152,
                              max_position_embeddings=64)
    out = tmp_path_factory.mktemp("pgb") / "bundle"
    export_bundle(folder, out, ExportOptions(draft_layers=1, progress=False))
    return out


def validate(bundle, *extra):
    result = CliRunner().invoke(cli, ["validate", str(bundle), "--polygraphy", *extra])
    return result


def validate_json(bundle):
    result = validate(bundle, "--json")
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, json.loads(result.output.strip().splitlines()[-1])["polygraphy"]


def by_role(report):
    return {c["role"]: c for c in report["checks"] if c["backend"] == "onnxruntime"}


def copy_of(bundle, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(bundle, dst)
    return dst


def test_reference_files_are_polygraphy_json(bundle):
    from polygraphy.comparator import RunResults
    from polygraphy.json import load_json

    records = json.loads((bundle / "manifest.json").read_text())["artifacts"]["reference_io"]
    assert set(records) == {"target", "draft"}
    for role, rec in records.items():
        feeds = load_json(bundle / rec["inputs"])
        assert isinstance(feeds, list) and len(feeds) == 1
        feed = feeds[0]
        assert feed["input_ids"].shape == (1, 6) and feed["input_ids"].dtype == np.int64
        assert feed["tree_mask"].dtype == np.bool_ and feed["tree_mask"].shape == (1, 6, 6)
        assert not feed["tree_mask"].all() and feed["tree_mask"][0].diagonal().all()  # a branching tree
        assert int(feed["past_len"][0]) == 0 and feed["past_key.0"].shape[2] == 16
        results = RunResults.load(bundle / rec["outputs"])
        assert list(results.keys()) == ["pytorch"]
        out = results["pytorch"][0]
        assert out["logits"].shape == (1, 6, 49152) and out["hidden_states"].shape[:2] == (1, 6)
        assert np.isfinite(out["logits"]).all() and np.abs(out["logits"]).max() > 0
        layers = 2 if role == "target" else 1
        assert {f"present_key.{i}" for i in range(layers)} <= set(out.keys())


def test_polygraphy_passes_on_fp32_bundle(bundle):
    code, report = validate_json(bundle)
    assert code == 0 and report["verdict"] == "pass", report
    roles = by_role(report)
    assert set(roles) == {"target", "draft"}
    for check in roles.values():
        assert check["precision"] == "fp32" and check["verdict"] == "pass"
        logits = check["outputs"]["logits"]
        assert logits["pass"] and logits["max_abs"] < 1e-4 and logits["peak"] == 2e-5, logits
        assert check["outputs"]["hidden_states"]["max_abs"] < 1e-4
        assert all(o["pass"] for o in check["outputs"].values())
        assert "present_key.0" in check["outputs"]  # the KV written by the window is checked too


def test_polygraphy_text_report(bundle):
    result = validate(bundle)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(line.startswith("polygraphy target: onnxruntime") and "→ pass" in line for line in lines)
    assert any(line.startswith("polygraphy draft: onnxruntime") for line in lines)
    assert any(line.strip().startswith("logits") and "max|Δ|" in line for line in lines)
    assert lines[-1] == "polygraphy: pass"


def test_scaled_reference_logits_fail(bundle, tmp_path):
    from polygraphy.comparator import RunResults

    b = copy_of(bundle, tmp_path)
    path = b / "reference" / "target_outputs.json"
    results = RunResults.load(path)
    out = results["pytorch"][0]
    out["logits"] = np.asarray(out["logits"]) * 1.01
    results.save(path)
    code, report = validate_json(b)
    assert code == 1 and report["verdict"] == "fail"
    target, draft = by_role(report)["target"], by_role(report)["draft"]
    assert target["verdict"] == "fail" and not target["outputs"]["logits"]["pass"]
    assert target["outputs"]["logits"]["max_abs"] > 1e-3
    assert target["outputs"]["hidden_states"]["pass"] and draft["verdict"] == "pass"
    text = validate(b)
    assert text.exit_code == 1
    assert "polygraphy target: onnxruntime (target/decoder.onnx, fp32) vs pytorch (fp32) → fail" in text.output
    assert any(line.strip().startswith("logits") and line.endswith("FAIL") for line in text.output.splitlines())


def test_corrupted_graph_weight_fails(bundle, tmp_path):
    b = copy_of(bundle, tmp_path)
    path = b / "draft" / "decoder.onnx"
    model = onnx.load(path)  # weights from decoder.onnx.data
    init = next(i for i in model.graph.initializer if i.name.endswith("norm.weight") and "layers" not in i.name)
    w = onnx.numpy_helper.to_array(init)
    init.CopyFrom(onnx.numpy_helper.from_array(w * 1.5, init.name))
    (b / "draft" / "decoder.onnx.data").unlink()
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location="decoder.onnx.data", size_threshold=1024)
    code, report = validate_json(b)
    assert code == 1 and report["verdict"] == "fail"
    draft = by_role(report)["draft"]
    assert draft["verdict"] == "fail"
    assert not draft["outputs"]["logits"]["pass"] and not draft["outputs"]["hidden_states"]["pass"]
    assert draft["outputs"]["present_key.0"]["pass"]  # the final norm cannot change the KV
    assert by_role(report)["target"]["verdict"] == "pass"


def test_missing_reference_files_say_to_reexport(bundle, tmp_path):
    b = copy_of(bundle, tmp_path)
    shutil.rmtree(b / "reference")
    proc = specrt("validate", b, "--polygraphy")
    assert_one_line_error(proc, "reference files of target are missing", "export the bundle again")
    manifest = json.loads((b / "manifest.json").read_text())
    del manifest["artifacts"]["reference_io"]
    (b / "manifest.json").write_text(json.dumps(manifest))
    proc = specrt("validate", b, "--polygraphy")
    assert_one_line_error(proc, "no PyTorch reference outputs", "export the bundle again")


def test_validate_needs_a_check(bundle):
    proc = specrt("validate", bundle)
    assert_one_line_error(proc, "choose a check: --lossless, --polygraphy and/or --quality")
