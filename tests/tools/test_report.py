"""`specrt bench --report`: the roofline's byte counts, the bandwidth probe, the stage profile and the
report files (written whole, never half)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from specrt.tools import report as report_mod
from specrt.tools import roofline as roofline_mod
from specrt.tools.report import row_overhead, stage_breakdown, write_report
from specrt.tools.roofline import (
    GraphWeights,
    bound_tokens_per_s,
    drafter_passes,
    graph_weight_bytes,
    graph_weights,
    measure_bandwidth,
    step_bytes,
)

PNGS = ("tokens_per_s.png", "acceptance_by_position.png", "stage_time.png")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ── bytes in a graph ──────────────────────────────────────────────────────────────────────────
def _init(name: str, array: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(array, name)


def small_graph(path: Path) -> Path:
    """A decoder-shaped graph: a MatMul weight, an fp16 weight, packed int4 weights, an embedding read
    only by Gather, a tied table read by Gather and MatMul, Gather indices, an unused tensor, one KV layer."""
    inits = [
        _init("w1", np.ones((4, 8), np.float32)),  # 128 B, MatMul
        _init("w2", np.ones((8, 3), np.float16)),  # 48 B, MatMul
        helper.make_tensor("q4", TensorProto.INT4, [5], [1, -2, 3, -4, 5]),  # 5 nibbles: 3 B, DequantizeLinear
        _init("q4_scale", np.ones((), np.float32)),  # 4 B
        _init("embed", np.ones((10, 4), np.float32)),  # 160 B, Gather data only: rows, not streamed
        _init("tied", np.ones((6, 4), np.float32)),  # 96 B, Gather and MatMul: streamed whole
        _init("idx", np.array([0, 1], np.int64)),  # 16 B, Gather indices: streamed
        _init("unused", np.ones((7,), np.float32)),  # 28 B, read by nothing
    ]
    nodes = [
        helper.make_node("Gather", ["embed", "ids"], ["e"]),
        helper.make_node("Gather", ["tied", "idx"], ["t"]),
        helper.make_node("MatMul", ["e", "w1"], ["h1"]),
        helper.make_node("MatMul", ["h1", "w2"], ["h2"]),
        helper.make_node("Transpose", ["tied"], ["tied_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["e", "tied_t"], ["logits"]),
        helper.make_node("DequantizeLinear", ["q4", "q4_scale"], ["dq"]),
    ]
    kv = [helper.make_tensor_value_info(f"past_{k}.0", TensorProto.FLOAT, ["batch", 2, "capacity", 4])
          for k in ("key", "value")]
    graph = helper.make_graph(
        nodes, "small", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["t"]), *kv],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("h2", "logits", "t", "dq")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=100)
    return path


def test_graph_weight_bytes_counts_streamed_initializers_exactly(tmp_path):
    path = small_graph(tmp_path / "small.onnx")
    stored = onnx.load(str(path), load_external_data=False).graph.initializer
    assert {t.name for t in stored if t.data_location == TensorProto.EXTERNAL} == {"w1", "embed", "tied"}
    assert graph_weight_bytes(path) == 128 + 48 + 3 + 4 + 96 + 16
    w = graph_weights(path)
    assert w.gathered == {"embed": 160}
    assert w.unused == {"unused": 28}
    assert w.kv_bytes_per_token == 2 * (2 * 4 * 4)  # key + value: heads × head_dim × 4 B


def test_step_bytes_and_the_bound():
    target = GraphWeights("t", streamed_bytes=1000, kv_bytes_per_token=10)
    layer = GraphWeights("layer", streamed_bytes=100, kv_bytes_per_token=2)
    fuse = GraphWeights("fuse", streamed_bytes=40)
    passes = drafter_passes([layer, fuse], depth=3)
    assert [p for _, p in passes] == [3.0, 1.0]  # the KV layer once per depth, the fuse once per step
    parts = step_bytes(target, 50, passes)
    assert parts == {"target_weights": 1000, "target_kv": 500, "drafter_weights": 340, "drafter_kv": 300,
                     "total": 2140}
    assert bound_tokens_per_s(2.0, 1.0, parts["total"]) == pytest.approx(2e9 / 2140)


class FakeClock:
    """perf_counter for roofline.measure_bandwidth: the times given, in order; then `tick` s later at
    each call."""

    def __init__(self, times: list[float], tick: float = 0.0):
        self.times, self.tick, self.now, self.calls = list(times), tick, 0.0, 0

    def perf_counter(self) -> float:
        self.calls += 1
        self.now = self.times.pop(0) if self.times else self.now + self.tick
        return self.now


def test_measure_bandwidth_is_bytes_over_the_best_pass(monkeypatch):
    """The arithmetic on known times: the best (shortest) of the passes, at least 3 of them, passes
    until `seconds` have gone by; GB = 1e9 bytes."""
    # calls: the deadline; then per pass its start and end; from the 4th pass on, a deadline check first
    clock = FakeClock([0.0, 0.0, 0.004, 0.004, 0.006, 0.006, 0.009, 0.5])
    monkeypatch.setattr(roofline_mod, "time", clock)
    size = 1 << 20
    assert measure_bandwidth(seconds=0.1, size_bytes=size) == size / 0.002 / 1e9  # 0.004, 0.002, 0.003 s
    assert clock.calls == 1 + 3 * 2 + 1  # three passes, then the deadline had gone by


def test_measure_bandwidth_stops_after_100_passes(monkeypatch):
    clock = FakeClock([], tick=0.001)  # 1 ms a call: 100 passes end long before the 1 s deadline
    monkeypatch.setattr(roofline_mod, "time", clock)
    size = 1 << 20
    assert measure_bandwidth(seconds=1.0, size_bytes=size) == pytest.approx(size / 0.001 / 1e9)
    # 3 passes, 97 more each after a deadline check, and the check that finds 100 done: not one more
    assert clock.calls == 1 + 3 * 2 + 97 * 3 + 1


def test_measure_bandwidth_measures_a_finite_positive_rate():
    """The real probe, on this machine: no bound on how fast it is."""
    gb_s = measure_bandwidth(seconds=0.05, size_bytes=16 << 20)
    assert math.isfinite(gb_s) and gb_s > 0


# ── the profile and the report files ──────────────────────────────────────────────────────────
def _row(drafter, pid, category, seconds, stages, new_tokens=10, steps=5, per_pos=()):
    return {"drafter": drafter, "id": pid, "category": category, "repeat": 0, "new_tokens": new_tokens,
            "seconds": seconds, "tokens_per_s": new_tokens / seconds, "mean_accepted_len": 2.0, "steps": steps,
            "accepted_per_position": list(per_pos), "identical_to_plain": True,
            "stage_seconds": dict(zip(("prefill", "propose", "verify", "accept", "commit"), stages, strict=True))}


def synthetic_result() -> dict:
    rows = [_row("plain", "a", "code", 1.0, (0.1, 0.0, 0.7, 0.05, 0.05), steps=9),
            _row("plain", "b", "chat", 2.0, (0.2, 0.0, 1.5, 0.1, 0.1), steps=9),
            _row("eagle3", "a", "code", 0.5, (0.1, 0.1, 0.2, 0.02, 0.03), per_pos=(4, 2)),
            _row("eagle3", "b", "chat", 0.8, (0.1, 0.2, 0.3, 0.05, 0.05), per_pos=(3,)),
            {"drafter": "llamacpp-plain", "id": "a", "category": "code", "repeat": 0, "new_tokens": 10,
             "seconds": 0.4, "tokens_per_s": 25.0, "mean_accepted_len": None, "identical_to_plain": None},
            {"drafter": "llamacpp-plain", "id": "b", "category": "chat", "repeat": 0, "new_tokens": 10,
             "seconds": 0.5, "tokens_per_s": 20.0, "mean_accepted_len": None, "identical_to_plain": None}]
    summary = {"plain": {"tokens_per_s_median": 7.5, "tokens_per_s_min": 5.0, "tokens_per_s_max": 10.0,
                         "speedup_vs_plain": 1.0, "speedup_vs": {"llamacpp-plain": 0.33},
                         "mean_accepted_len": 1.0, "acceptance_by_position": [], "identical": "2/2"},
               "eagle3": {"tokens_per_s_median": 16.25, "speedup_vs_plain": 2.2, "mean_accepted_len": 2.0,
                          "speedup_vs": {"llamacpp-plain": 0.72}, "acceptance_by_position": [0.7, 0.2],
                          "identical": "2/2"},
               "llamacpp-plain": {"tokens_per_s_median": 22.5, "speedup_vs_plain": 3.0,
                                  "mean_accepted_len": None, "acceptance_by_position": [],
                                  "identical": "reference"}}
    return {"config": {"configs": ["plain", "eagle3"], "peers": ["llamacpp-plain"], "max_new_tokens": 10},
            "rows": rows, "summary": summary, "by_category": {}}


def test_stage_breakdown_overhead_is_seconds_minus_the_stages():
    result = synthetic_result()
    rows = result["rows"]
    assert row_overhead(rows[0]) == pytest.approx(1.0 - 0.9)
    assert row_overhead(rows[4]) is None  # a peer: no stage times
    prof = stage_breakdown(rows)
    assert set(prof) == {"plain", "eagle3"}
    # eagle3: 1.3 s for 20 tokens; its stages sum to 1.15 s: overhead 0.15 s = 7.5 ms per token
    assert prof["eagle3"]["python_overhead"] == pytest.approx(1000 * (1.3 - 1.15) / 20)
    assert prof["eagle3"]["propose"] == pytest.approx(1000 * 0.3 / 20)
    assert prof["plain"]["python_overhead"] == pytest.approx(1000 * ((1.0 - 0.9) + (2.0 - 1.9)) / 20)
    assert prof["eagle3"]["total"] == pytest.approx(
        sum(v for k, v in prof["eagle3"].items() if k != "total"), abs=1e-3)


def _roofline() -> dict:
    parts = {"target_weights": 500_000_000, "target_kv": 2_000_000, "drafter_weights": 180_000_000,
             "drafter_kv": 400_000, "total": 682_400_000}
    eng = {"bytes_per_step": parts["total"], "parts": parts, "tokens_per_step": 2.0, "mean_context": 60.0,
           "bound_tokens_per_s": 29.3, "measured_tokens_per_s": 10.0, "fraction_of_bound": 0.341,
           "measured_gb_s": 3.41, "drafter_passes": {"layer.onnx": 5.0}}
    return {"bandwidth_gb_s": 10.0, "bandwidth_method": "test",
            "target": {"path": "t.onnx", "streamed_bytes": 500_000_000, "gathered": {}, "unused": {},
                       "kv_bytes_per_token": 46080},
            "drafter_graphs": {"eagle3": {"gathered": {"embed_tokens.weight": 113_246_208}}},
            "peers": ["llamacpp-plain"], "configs": {"eagle3": eng}}


def _leftovers(parent: Path, out: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p != out]


def test_write_report_writes_markdown_json_and_plots(tmp_path):
    out = tmp_path / "rep"
    assert write_report(synthetic_result(), out, _roofline()) == out
    for name in PNGS:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    md = (out / "report.md").read_text()
    for engine in ("plain", "eagle3", "llamacpp-plain"):
        assert f"| {engine} |" in md
    assert "34.1" in md and "10.00 GB/s" in md and "embed_tokens.weight" in md  # % of bound, bandwidth
    assert "× llamacpp-plain" in md  # speedup against the peer, from `speedup_vs`
    data = json.loads((out / "report.json").read_text())
    assert data["result"]["config"]["configs"] == ["plain", "eagle3"]
    assert data["profile"]["stage_ms_per_token"]["eagle3"]["python_overhead"] == pytest.approx(7.5)
    assert data["profile"]["tokens_per_s_by_category"]["eagle3"] == {"code": 20.0, "chat": 12.5}
    assert data["roofline"]["configs"]["eagle3"]["fraction_of_bound"] == 0.341
    assert _leftovers(tmp_path, out) == []
    assert sorted(p.name for p in out.iterdir()) == sorted(report_mod.REPORT_FILES)


def test_write_report_replaces_an_existing_report_and_never_half_writes(tmp_path, monkeypatch):
    out = tmp_path / "rep"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    write_report(synthetic_result(), out, None)  # no roofline: the section says so
    assert "Not measured" in (out / "report.md").read_text()
    assert (out / "notes.txt").read_text() == "mine" and _leftovers(tmp_path, out) == []
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(*_a, **_k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(report_mod, "plot_stage_time", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        write_report(synthetic_result(), out, _roofline())
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the old report, untouched
    assert _leftovers(tmp_path, out) == []


# ── the command ───────────────────────────────────────────────────────────────────────────────
@pytest.fixture()
def small_bundle(tiny_bundle):
    return tiny_bundle


def test_bench_report_command_writes_the_report(small_bundle, tmp_path, monkeypatch):
    """The command end to end, with the bandwidth probe's answer injected (12.5 GB/s, as if measured):
    the roofline's arithmetic is checked on known numbers, whatever this machine's speed."""
    from click.testing import CliRunner

    from specrt.cli import cli
    from specrt.schema.manifest import Manifest

    probed = []
    monkeypatch.setattr(roofline_mod, "measure_bandwidth", lambda **kw: probed.append(kw) or 12.5)

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "category": "code", "prompt": "def f(x): return x"}\n'
                       '{"id": "b", "category": "chat", "prompt": "hello there, how are"}\n')
    out = tmp_path / "rep"
    res = CliRunner().invoke(cli, ["bench", str(small_bundle), "--prompts", str(prompts), "--raw",
                                   "--drafters", "ngram,draft", "--max-new-tokens", "6", "--report", str(out)])
    assert res.exit_code == 0, (res.output, res.exception)
    assert f"report written: {out}" in res.output
    for name in PNGS:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    md = (out / "report.md").read_text()
    assert all(f"| {e} |" in md for e in ("plain", "ngram", "draft"))
    roof = json.loads((out / "report.json").read_text())["roofline"]
    assert len(probed) == 1 and probed[0]["threads"] >= 1  # probed once, with the benchmark's threads
    assert roof["bandwidth_gb_s"] == 12.5 and "12.50 GB/s" in md
    manifest = Manifest.load(small_bundle)
    cfg = manifest.target.config
    assert roof["target"]["kv_bytes_per_token"] == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert roof["target"]["streamed_bytes"] == graph_weight_bytes(manifest.onnx_path(small_bundle, "target"))
    # the untied embedding is only gathered: listed, not streamed
    assert list(roof["target"]["gathered"].values()) == [cfg.vocab_size * cfg.hidden_size * 4]
    eng = roof["configs"]
    assert set(eng) == {"plain", "ngram", "draft"}
    assert eng["plain"]["parts"]["drafter_weights"] == eng["ngram"]["parts"]["drafter_weights"] == 0
    draft = graph_weight_bytes(manifest.onnx_path(small_bundle, "draft"))
    assert eng["draft"]["parts"]["drafter_weights"] == 5 * draft  # k = 5 passes of the draft model
    for e in eng.values():
        assert e["bytes_per_step"] > roof["target"]["streamed_bytes"]
        # bound = tokens/step × bandwidth ÷ bytes/step (tokens/step rounded to 4 places, the bound to 2)
        assert e["bound_tokens_per_s"] == pytest.approx(e["tokens_per_step"] * 12.5e9 / e["bytes_per_step"],
                                                        rel=1e-4, abs=0.005)
        # fraction = measured ÷ bound, from the unrounded two (each rounded to 2 places) then to 4 places
        measured, bound = e["measured_tokens_per_s"], e["bound_tokens_per_s"]
        slack = 5e-5 + 0.005 / bound + measured * 0.005 / (bound * (bound - 0.005))
        assert e["fraction_of_bound"] == pytest.approx(measured / bound, abs=slack)
        assert e["measured_gb_s"] == pytest.approx(e["fraction_of_bound"] * 12.5, rel=1e-2, abs=0.01)
