"""The TensorRT path, as far as it can be checked without TensorRT or a GPU.

Checked here: the build plan (profiles, version gate, manifest entry, prefill chunks), the gated
entry points (one clear line naming what to install), what the ONNX parser needs on the exported
custom-op nodes, and that the TreeAttention AOT wrapper compiles to PTX in the AOT argument order.
Not checked here: building or running an engine (engines/trt/build.py `build_trt`, engines/trt/runner.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

from specrt.engines.trt import profiles as plan
from specrt.engines.trt.build import INSTALL_HINT, tensorrt_available
from specrt.errors import SpecrtError
from specrt.schema.manifest import Manifest

no_tensorrt = pytest.mark.skipif(tensorrt_available(), reason="TensorRT is installed: the gate does not fire")

CAPACITY, WINDOW = 32, 8


def _feeds(inputs, t: int, r: int) -> dict[str, tuple[int, ...]]:
    """Concrete input shapes of one pass with window t and r logits rows."""
    sizes = {"batch": 1, "tokens": t, "rows": r, "capacity": CAPACITY}
    return {name: tuple(sizes[d] if isinstance(d, str) else d for d in dims) for name, dims in inputs}


def _covers(profile, shape) -> bool:
    lo, _, hi = profile
    return len(lo) == len(shape) and all(a <= s <= b for a, s, b in zip(lo, shape, hi, strict=True))


# ── profiles ──────────────────────────────────────────────────────────────────────────────────────
def test_profiles_cover_one_token_and_the_max_window_for_every_graph_input(tiny_bundle):
    manifest = Manifest.load(tiny_bundle)
    for role, entry in manifest.graphs.items():
        inputs = plan.graph_inputs(tiny_bundle / entry.file)
        shapes = plan.profile_shapes(inputs, entry.config, CAPACITY, WINDOW)
        assert set(shapes) == {name for name, _ in inputs}, role
        for t, r in [(1, 1), (WINDOW, 1), (WINDOW, WINDOW), (1, WINDOW)]:
            for name, shape in _feeds(inputs, t, r).items():
                assert _covers(shapes[name], shape), (role, name, shape, shapes[name])
        for name, dims in inputs:
            if "tokens" in dims or "rows" in dims:
                assert shapes[name][2] != shapes[name][0], (role, name)  # a dynamic window
            lo, opt, hi = shapes[name]
            assert all(a <= o <= b for a, o, b in zip(lo, opt, hi, strict=True))
        kv = {n: s for n, s in shapes.items() if n.startswith(("past_key.", "past_value."))}
        assert len(kv) == 2 * entry.config.num_layers, role
        for name, (lo, opt, hi) in kv.items():  # static KV buffers: capacity rows, batch 1
            assert lo == opt == hi == (1, entry.config.num_kv_heads, CAPACITY, entry.config.head_dim), name
            assert name not in plan.dynamic_inputs(shapes)
        assert "input_ids" in plan.dynamic_inputs(shapes)
        assert plan.pinned_shape(*shapes["input_ids"][::2]) == (1, -1)


def test_profiles_refuse_what_they_cannot_describe(tiny_bundle):
    manifest = Manifest.load(tiny_bundle)
    cfg = manifest.target.config
    inputs = plan.graph_inputs(tiny_bundle / manifest.target.file)
    with pytest.raises(SpecrtError, match="'seq'"):
        plan.profile_shapes([*inputs, ("extra", ["batch", "seq"])], cfg, CAPACITY, WINDOW)
    bad_kv = [(n, ["batch", cfg.num_kv_heads + 1, "capacity", cfg.head_dim] if n == "past_key.0" else d)
              for n, d in inputs]
    with pytest.raises(SpecrtError, match="past_key.0"):
        plan.profile_shapes(bad_kv, cfg, CAPACITY, WINDOW)
    with pytest.raises(SpecrtError, match="capacity"):
        plan.profile_shapes(inputs, cfg, 4, WINDOW)


@pytest.mark.parametrize(("version", "ok"), [
    ("10.14.1.48", False), ("10.14", False), ("9.9.0", False), ("10", False), ("", False), ("unknown", False),
    ("10.15.0", True), ("10.15.1.29", True), ("10.15", True), ("10.16.0.post1", True), ("11.0.0", True),
])
def test_version_gate_is_tensorrt_10_15(version, ok):
    assert plan.version_ok(version) is ok
    if not ok:
        assert "10.15" in plan.version_message(version)


def test_manifest_entry_and_engine_files():
    assert plan.engine_file("target/decoder.onnx", "fp16") == "target/decoder.fp16.engine"
    assert plan.engine_file("mtp/module_0.onnx", "bf16") == "mtp/module_0.bf16.engine"
    shapes = {"input_ids": ((1, 1), (1, 8), (1, 8))}
    entry = plan.manifest_entry("10.15.1.29", "fp16", 32, 8, {
        "target": {"file": "target/decoder.fp16.engine", "profile": shapes, "seconds": 1.5}})
    entry = json.loads(json.dumps(entry))  # stored in manifest.json as is
    assert entry["tensorrt"] == "10.15.1.29" and entry["precision"] == "fp16"
    assert entry["plugins"]["namespace"] == "specrt" and entry["plugins"]["version"] == "1"
    assert entry["parser_flags"] == ["ENABLE_PLUGIN_OVERRIDE"]
    assert entry["graphs"]["target"]["profile"]["input_ids"] == [[1, 1], [1, 8], [1, 8]]
    assert entry["timing_cache"] == plan.TIMING_CACHE
    with pytest.raises(SpecrtError, match="precision"):
        plan.manifest_entry("10.15.1", "int8", 32, 8, {})


def test_quantized_bundles_are_refused_for_tensorrt(tiny_bundle):
    manifest = Manifest.load(tiny_bundle)
    plan.check_bundle(manifest)  # not quantized: fine
    manifest.artifacts["quantization"] = {"scheme": "int4"}
    with pytest.raises(SpecrtError, match="without --quantize"):
        plan.check_bundle(manifest)


def test_long_prefill_is_split_into_causal_chunks_with_the_rows_in_the_last():
    t = 19
    causal = np.tril(np.ones((t, t), bool))[None]
    assert plan.plan_chunks(causal[:, :8, :8], np.array([[7]]), 8) == [(0, 8)]
    assert plan.plan_chunks(causal, np.array([[t - 1]]), 8) == [(0, 8), (8, 16), (16, 19)]
    with pytest.raises(SpecrtError, match="last prefill chunk"):
        plan.plan_chunks(causal, np.array([[3]]), 8)
    tree = causal.copy()
    tree[0, 5, 4] = False  # siblings: not a plain prefill
    with pytest.raises(SpecrtError, match="window"):
        plan.plan_chunks(tree, np.array([[t - 1]]), 8)


# ── what the ONNX parser needs on the exported graph ─────────────────────────────────────────────
def test_custom_op_nodes_name_the_plugin(tiny_bundle):
    manifest = Manifest.load(tiny_bundle)
    model = onnx.load(str(tiny_bundle / manifest.target.file), load_external_data=False)
    assert ("specrt", "TreeAttention") in {(f.domain, f.name) for f in model.functions}
    assert "specrt" in {o.domain for o in model.opset_import}
    nodes = [n for n in model.graph.node if n.domain == "specrt"]
    assert [n.op_type for n in nodes] == ["TreeAttention"] * manifest.target.config.num_layers
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["plugin_namespace"] == b"specrt" and attrs["plugin_version"] == b"1", node.name
        assert {"num_heads", "num_kv_heads", "head_dim"} <= set(attrs)  # the plugin's attributes


# ── gated entry points ────────────────────────────────────────────────────────────────────────────
def test_importing_the_gpu_modules_needs_neither_tensorrt_nor_torch():
    code = ("import sys, specrt.engines.trt.build, specrt.plugins.tensorrt_plugins, specrt.engines.trt.runner; "
            "print(sorted(m for m in ('tensorrt', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-1500:]
    assert out.stdout.strip() == "[]"


@no_tensorrt
def test_entry_points_without_tensorrt_say_what_to_install(tiny_bundle, tmp_path):
    from specrt.engines.trt.build import build_trt
    from specrt.engines.trt.runner import TrtDecoder
    from specrt.plugins.tensorrt_plugins import register_plugins

    manifest = Manifest.load(tiny_bundle)
    calls = [lambda: register_plugins(), lambda: build_trt(tiny_bundle, manifest, "fp16"),
             lambda: TrtDecoder(tmp_path / "x.engine", manifest.target.config, CAPACITY, WINDOW)]
    for call in calls:
        with pytest.raises(SpecrtError) as e:
            call()
        assert str(e.value) == INSTALL_HINT


@no_tensorrt
def test_build_backend_trt_without_tensorrt_is_one_line(tiny_bundle):
    before = (tiny_bundle / "manifest.json").read_text()
    proc = subprocess.run([sys.executable, "-c", "from specrt.cli import main; main()", "build", str(tiny_bundle),
                           "--backend", "trt"], capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert lines == [f"specrt: error: {INSTALL_HINT}"], proc.stdout + proc.stderr
    assert (tiny_bundle / "manifest.json").read_text() == before


# ── the TreeAttention AOT kernel, compiled for a GPU target on the CPU ───────────────────────────
AOT_CHECK = """
import json, re
from triton.backends.compiler import GPUTarget
from specrt.plugins.tensorrt_plugins import TREE_ATTENTION_SCALARS, compile_tree_attention
out = {}
for dtype in ("fp32", "fp16"):
    c = compile_tree_attention(dtype, "i64", head_dim=64, max_window=8, target=GPUTarget("cuda", 90, 32))
    entry = re.search(r"\\.entry\\s+(\\w+)\\s*\\(([^)]*)\\)", c.asm["ptx"])
    params = [p.strip().split()[1] for p in entry.group(2).split(",")]
    out[dtype] = {"name": entry.group(1), "meta": c.metadata.name, "params": params,
                  "warps": c.metadata.num_warps, "scalars": len(TREE_ATTENTION_SCALARS)}
print(json.dumps(out))
"""


def test_tree_attention_aot_wrapper_compiles_to_ptx_in_the_aot_argument_order():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # tests/plugins sets it
    proc = subprocess.run([sys.executable, "-c", AOT_CHECK], capture_output=True, text=True, timeout=600, env=env)
    if proc.returncode != 0 and "ptxas" in proc.stderr.lower():
        pytest.skip("this triton cannot compile for a CUDA target here: " + proc.stderr.splitlines()[-1][:200])
    assert proc.returncode == 0, proc.stderr[-2000:]
    for dtype, r in json.loads(proc.stdout.splitlines()[-1]).items():
        assert r["name"] == r["meta"] and r["warps"] == 4, dtype
        params, n = r["params"], r["scalars"]
        assert n == 18
        assert params[:5] == [".u64"] * 5, (dtype, params)  # q, k, v, past_len, tree_mask pointers
        assert params[5 : 5 + n] == [".u32"] * n, (dtype, params)  # int32 scalars
        assert params[5 + n] == ".u64", (dtype, params)  # out pointer
        # anything after is Triton's hidden scratch pointers, which the AOT launch does not pass
        assert all(p == ".u64" for p in params[6 + n :]), (dtype, params)


# ── `specrt build` settings ───────────────────────────────────────────────────────────────────────
def test_build_passes_capacity_and_window_to_the_tensorrt_build(tiny_bundle, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from specrt.cli import cli
    from specrt.engines.trt import build as trt

    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "manifest.json").write_text((tiny_bundle / "manifest.json").read_text())  # all build reads here
    seen = {}

    def fake_build(path, manifest, precision, capacity=None, max_window=None, progress=True):
        seen.update(precision=precision, capacity=capacity, max_window=max_window)
        return plan.manifest_entry("10.15.1", precision, capacity, max_window, {})

    monkeypatch.setattr(trt, "build_trt", fake_build)
    args = ["build", str(bundle), "--backend", "trt", "--precision", "fp32", "--max-seq-len", "40", "--max-window", "12"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert seen == {"precision": "fp32", "capacity": 40, "max_window": 12}
    entry = Manifest.load(bundle).artifacts["tensorrt"]
    assert (entry["capacity"], entry["max_window"]) == (40, 12)
    assert CliRunner().invoke(cli, ["build", str(bundle), "--backend", "trt", "--max-window", "0"]).exit_code == 2
