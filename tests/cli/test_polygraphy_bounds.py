"""`specrt validate --polygraphy` can fail: a graph with one weight nudged (o_proj × 1.01, × 1.0001, noise on
a norm weight) exits 1 naming the output, its max |Δ| and the bound, while the untouched graph passes; the
rules table (engines/trt/polygraphy_rules.py) covers every precision a bundle or engine can have, and its
quantized bounds refuse noise beyond the measured one (an int4 KV cosine of 0.55 fails)."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from specrt.cli import cli
from specrt.engines.trt.polygraphy_rules import RULES, Bound, Rule, bound_of, rule_for
from specrt.errors import SpecrtError


def validate(bundle, *extra):
    return CliRunner().invoke(cli, ["validate", str(bundle), "--polygraphy", *extra])


def report_of(bundle) -> tuple[int, dict]:
    result = validate(bundle, "--json")
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, json.loads(result.output.strip().splitlines()[-1])["polygraphy"]


def checks(report) -> dict:
    return {c["role"]: c for c in report["checks"] if c["backend"] == "onnxruntime"}


def perturbed(bundle, tmp_path, initializer: str, change) -> object:
    """A copy of `bundle` whose target graph has initializer `initializer` replaced by change(weights)."""
    dst = tmp_path / "bundle"
    shutil.copytree(bundle, dst)
    path = dst / "target" / "decoder.onnx"
    model = onnx.load(path)
    init = next(i for i in model.graph.initializer if i.name == initializer)
    init.CopyFrom(onnx.numpy_helper.from_array(change(onnx.numpy_helper.to_array(init)).astype(np.float32),
                                               init.name))
    (dst / "target" / "decoder.onnx.data").unlink()
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location="decoder.onnx.data", size_threshold=1024)
    return dst


def test_untouched_fp32_graph_passes_inside_its_bound(tiny_bundle):
    code, report = report_of(tiny_bundle)
    assert code == 0 and report["verdict"] == "pass", report
    for check in checks(report).values():
        assert (check["precision"], check["vs_precision"]) == ("fp32", "fp32")
        for name, o in check["outputs"].items():
            assert o["pass"] and o["peak"] == 2e-5, (name, o)
            assert o["bound"] == pytest.approx(2e-5 * o["ref_peak"]) and o["max_abs"] < o["bound"] / 4, (name, o)


NOISE = np.random.default_rng(0)


@pytest.mark.parametrize("initializer, change, failing, passing", [
    # layer 0's attention output feeds layer 1: its KV, the hidden states and the logits move; layer 0's KV cannot
    ("model.layers.0.o_proj.weight", lambda w: w * 1.01, {"logits", "hidden_states", "present_key.1"},
     {"present_key.0", "present_value.0"}),
    # 0.01 %, and noise of σ 1e-4 on a norm weight: both pass the old fp32 tolerance (an element failed only
    # past atol 1e-3 and rtol 1e-3), both are far outside fp32 rounding (measured ≤ 5e-7 of the range here)
    ("model.layers.0.o_proj.weight", lambda w: w * 1.0001, {"logits", "hidden_states", "present_key.1"},
     {"present_key.0", "present_value.0"}),
    ("model.layers.1.input_layernorm.weight", lambda w: w + NOISE.normal(0, 1e-4, w.shape),
     {"logits", "hidden_states", "present_key.1"}, {"present_key.0", "present_value.0"}),
], ids=["o_proj*1.01", "o_proj*1.0001", "norm+noise"])
def test_perturbed_graph_fails_naming_output_value_and_bound(tiny_bundle, tmp_path, initializer, change, failing,
                                                             passing):
    b = perturbed(tiny_bundle, tmp_path, initializer, change)
    code, report = report_of(b)
    assert code == 1 and report["verdict"] == "fail"
    target, draft = checks(report)["target"], checks(report)["draft"]
    assert target["verdict"] == "fail" and draft["verdict"] == "pass"  # only the target graph was changed
    outputs = target["outputs"]
    for name in failing:
        o = outputs[name]
        assert not o["pass"] and o["max_abs"] > o["bound"], (name, o)
        assert any(f.startswith("max|Δ|") and f"bound {o['bound']:.3e}" in f for f in o["failed"]), o
    for name in passing:
        assert outputs[name]["pass"], (name, outputs[name])

    text = validate(b)
    assert text.exit_code == 1
    last = text.output.splitlines()[-1]
    m = re.search(r"target onnxruntime logits: max\|Δ\| (\S+) > bound (\S+) \(2e-05 × max\|ref\| \S+\)", last)
    assert last.startswith("polygraphy: fail — ") and m, last
    assert float(m[1]) == pytest.approx(outputs["logits"]["max_abs"], rel=1e-3) and float(m[1]) > float(m[2])
    logits_line = next(line for line in text.output.splitlines() if line.strip().startswith("logits"))
    assert logits_line.endswith("FAIL") and "bound" in logits_line  # the first (target) logits line


# ── the rules table, on synthetic outputs ───────────────────────────────────────────────────────────

def compare_arrays(rule: Rule, got: dict, want: dict) -> dict:
    from polygraphy.comparator import RunResults

    from specrt.engines.trt.polygraphy_check import compare

    results = RunResults()
    results.add([got], runner_name="graph")
    results.add([want], runner_name="pytorch")
    return compare(results, "graph", "pytorch", rule)


def test_rules_cover_every_precision():
    from specrt.export.quantize import SCHEMES

    for scheme in SCHEMES:  # a quantized bundle's graphs against the fp32 PyTorch reference
        rule = rule_for(scheme, "fp32")
        assert bound_of(rule, "present_value.29").min_cosine is not None  # its KV is held by a cosine
    for engine in ("fp16", "bf16", "fp32"):  # `specrt build --backend trt --precision` vs the fp32 graph
        rule_for(engine, "fp32")
    assert all(set(r.bounds) == {"logits", "hidden_states", "aux_hidden_states", "kv"} for r in RULES.values())
    with pytest.raises(SpecrtError, match="no Polygraphy rule for a int4 graph against a int8 reference"):
        rule_for("int4", "int8")
    with pytest.raises(SpecrtError, match="no Polygraphy bound for output 'medusa_logits'"):
        bound_of(rule_for("fp32", "fp32"), "medusa_logits")


def test_int4_kv_cosine_beyond_the_measured_noise_fails():
    rng = np.random.default_rng(1)
    want = rng.normal(size=(1, 3, 16, 64)).astype(np.float32)
    noise = rng.normal(size=want.shape).astype(np.float32)
    got = (want + 1.5 * noise).astype(np.float32)  # cosine ≈ 0.55 (the old rule's minimum was 0.5)
    out = compare_arrays(rule_for("int4", "fp32"), {"present_value.3": got}, {"present_value.3": want})
    o = out["present_value.3"]
    assert 0.5 < o["cosine"] < 0.59 and not o["pass"] and o["failed"] == [f"cosine {o['cosine']:.4f} < 0.59"]
    near = (want + 0.5 * noise).astype(np.float32)  # cosine ≈ 0.89: inside int4's measured noise (0.73)
    assert compare_arrays(rule_for("int4", "fp32"), {"present_value.3": near}, {"present_value.3": want}
                          )["present_value.3"]["pass"]


def test_fp32_bound_scales_with_the_output_range():
    want = np.linspace(-300.0, 300.0, 600, dtype=np.float32).reshape(1, 6, 100)
    rule = rule_for("fp32", "fp32")
    inside = compare_arrays(rule, {"logits": want + np.float32(1e-3)}, {"logits": want})["logits"]
    outside = compare_arrays(rule, {"logits": want + np.float32(1e-2)}, {"logits": want})["logits"]
    assert inside["pass"] and inside["bound"] == pytest.approx(6e-3)  # 2e-5 × 300
    assert not outside["pass"] and outside["failed"][0].startswith("max|Δ| 1.0")


def test_non_finite_output_fails_even_where_unbounded():
    want = np.ones((1, 2, 8, 4), np.float32)
    got = want.copy()
    got[0, 0, 0, 0] = np.nan
    rule = Rule({"logits": Bound(None), "hidden_states": Bound(None), "aux_hidden_states": Bound(None),
                 "kv": Bound(None)}, "test")
    o = compare_arrays(rule, {"present_key.0": got}, {"present_key.0": want})["present_key.0"]
    assert not o["pass"] and "not finite" in o["failed"][0]
