"""Exactness where the bundle runs: execution modes, the invariance measurement, its records and
caches, and what the runtime does when no mode is exact (tells the user, falls back to plain)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from specrt.cli import cli
from specrt.engines.registry import make_decoder
from specrt.runtime import exactness, invariance
from specrt.runtime.exec_modes import MAX_PAD_ROWS, MODES, ShapedDecoder, pad_pass
from specrt.runtime.generate import Generator
from specrt.runtime.machine import Fingerprint
from specrt.runtime.tree import Tree
from specrt.schema.manifest import Manifest
from tests.helpers import share_native_kernels


@pytest.fixture()
def home(tmp_path, monkeypatch):
    """A fresh $SPECRT_HOME: no machine cache yet (the compiled native kernels aside)."""
    share_native_kernels(tmp_path / "home")
    monkeypatch.setenv("SPECRT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_pad_pass_adds_rows_that_see_only_themselves():
    tree = Tree.from_parents([-1])
    ids, pos, past, mask, rows = pad_pass(3, np.array([[7]]), np.array([[5]]), np.array([5]), tree.mask[None],
                                          np.array([[0]]))
    assert ids.tolist() == [[7, 0, 0]] and pos.tolist() == [[5, 5, 5]] and past.tolist() == [5]
    assert mask[0].tolist() == np.eye(3, dtype=bool).tolist()
    assert rows.tolist() == [[0, 0, 0]]
    big = Tree.chain(3)  # already 4 rows: unchanged
    out = pad_pass(3, np.zeros((1, 4), np.int64), big.depth[None], np.array([0]), big.mask[None], np.array([[3]]))
    assert out[3] is not None and out[3].shape == (1, 4, 4) and out[4].tolist() == [[3, 3, 3]]


def _decoder(bundle, batch=3):
    m = Manifest.load(bundle)
    return make_decoder("ort", m.onnx_path(bundle, "target"), m.target.config, invariance.ROWS + MAX_PAD_ROWS,
                        threads=2, batch=batch), m.target.config.vocab_size


def test_shaped_decoder_returns_the_rows_asked_for(tiny_bundle):
    dec, _ = _decoder(tiny_bundle, batch=1)
    shaped = ShapedDecoder(dec, MODES["pad4"])
    chain = Tree.chain(0)
    outs = shaped.run_all(np.array([[5]]), np.array([[0]]), np.array([0]), chain.mask[None], np.array([[0]]))
    assert outs["logits"].shape == (1, 1, 49152) and outs["hidden_states"].shape[:2] == (1, 1)
    direct = dec.run_all(np.array([[5]]), np.array([[0]]), np.array([0]), chain.mask[None], np.array([[0]]))
    np.testing.assert_allclose(outs["logits"], direct["logits"], atol=1e-4)  # the same row, maybe another kernel


class _OneRowDrifts:
    """A real decoder whose passes drift by `eps` when they have fewer than `below` rows over all their
    sequences (the kernels' M: an M=1 GEMV that rounds differently), or always when `below` is None (no
    mode can help)."""

    def __init__(self, inner, below: int | None, eps: float = 1e-3):
        self.inner, self.below, self.eps = inner, below, eps

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run_all(self, input_ids, *args, **kw):
        outs = dict(self.inner.run_all(input_ids, *args, **kw))
        m = input_ids.shape[0] * input_ids.shape[1]
        if self.below is None or m < self.below:
            outs["logits"] = outs["logits"] + self.eps * m
        return outs


@pytest.mark.parametrize("below,expect", [(2, "pad2"), (3, "pad4"), (None, None)])
def test_choose_finds_the_cheapest_invariant_mode(tiny_bundle, below, expect):
    dec, vocab = _decoder(tiny_bundle)
    chosen, measured = invariance.choose(_OneRowDrifts(dec, below), vocab)
    assert chosen == expect
    assert measured["direct"]["invariant"] is False and measured["direct"]["chain"] > 0
    assert list(measured) == (list(MODES)[: list(MODES).index(expect) + 1] if expect else list(MODES))


def test_tiny_bundle_has_an_invariant_mode_here(tiny_bundle):
    """The property itself, on whatever CPU runs this: some mode gives plain decoding's rows exactly."""
    dec, vocab = _decoder(tiny_bundle)
    chosen, measured = invariance.choose(dec, vocab)
    assert chosen is not None, measured
    assert all(measured[chosen][c] == 0.0 for c in invariance.CHECKS), measured[chosen]


def test_export_records_this_machine_and_load_uses_it(tiny_bundle, home):
    m = Manifest.load(tiny_bundle)
    fp = Fingerprint.here(2)
    key = f"{fp.key}/{m.graphs['target'].file}"
    assert key in m.artifacts["exactness"], list(m.artifacts["exactness"])
    e = exactness.resolve(tiny_bundle, m, threads=2)
    assert e.source == "bundle record" and e.lossless and e.mode.name == m.artifacts["exactness"][key]["chosen"]
    assert {p.name for p in (home / "cache").glob("*")} <= {"native"}  # no exactness measured, nothing cached


def test_another_machine_measures_once_then_reads_its_cache(tiny_bundle, home):
    m = Manifest.load(tiny_bundle)
    m.artifacts["exactness"] = {}  # as if exported elsewhere
    first = exactness.resolve(tiny_bundle, m, threads=1)
    assert first.source == "measured now" and first.lossless
    assert len(list((home / "cache" / "exactness").glob("*.json"))) == 1
    again = exactness.resolve(tiny_bundle, m, threads=1)
    assert again.source == "machine cache" and again.to_dict() == {**first.to_dict(), "source": "machine cache"}
    forced = exactness.resolve(tiny_bundle, m, threads=1, requested="pad4")  # not measured yet: measured now
    assert forced.source == "measured now" and forced.mode.name == "pad4"


def test_an_export_of_the_same_graph_reuses_its_measurement(tiny_bundle, home, tmp_path, monkeypatch):
    """Export and build measure through a cache keyed by the graph's bytes: a copy (new files, new times) is
    answered from it, changed bytes or another thread count are measured again."""
    import shutil

    import onnx

    copy = tmp_path / "copy"
    shutil.copytree(tiny_bundle, copy)
    measured = []
    real = exactness.measure_record
    monkeypatch.setattr(exactness, "measure_record", lambda *a, **k: measured.append(a[3]) or real(*a, **k))
    first = exactness.measured_here(tiny_bundle, Manifest.load(tiny_bundle), 2, "ort")
    assert measured == ["ort"] and len(list((home / "cache" / "exactness").glob("content-*.json"))) == 1
    m = Manifest.load(copy)
    assert exactness.measured_here(copy, m, 2, "ort") == first and measured == ["ort"]
    exactness.measured_here(copy, m, 1, "ort")  # another machine fingerprint
    graph = copy / m.graphs["target"].file
    model = onnx.load(str(graph), load_external_data=False)
    model.doc_string = "other bytes"
    onnx.save_model(model, str(graph))
    again = exactness.measured_here(copy, m, 2, "ort")
    assert measured == ["ort"] * 3 and again["chosen"] == first["chosen"]


def test_the_content_key_covers_the_external_data_a_graph_names(tmp_path):
    fp = Fingerprint.here(2)
    graph = tmp_path / "g.onnx"
    graph.write_bytes(b"graph naming g.onnx.data")
    (tmp_path / "g.onnx.data").write_bytes(b"weights")
    (tmp_path / "other.onnx.data").write_bytes(b"x")
    key = exactness.content_key(graph, fp)
    (tmp_path / "other.onnx.data").write_bytes(b"y")  # not named by the graph
    assert exactness.content_key(graph, fp) == key
    (tmp_path / "g.onnx.data").write_bytes(b"weightz")
    assert exactness.content_key(graph, fp) != key
    assert exactness.content_key(graph, Fingerprint.here(1)) != exactness.content_key(graph, fp)


def _inexact(monkeypatch, tiny_bundle):
    """Make every Generator believe no mode is exact on this machine (a measured record saying so)."""
    m = Manifest.load(tiny_bundle)
    drift = {"chain": 0.5, "tree": 0.5, "batch": 0.5, "kv": 0.5, "invariant": False, "seconds": 0.1}
    record = {"fingerprint": Fingerprint.here(2).to_dict(), "key": "x", "graph": m.graphs["target"].file,
              "chosen": None, "measured": {name: dict(drift) for name in MODES}, "measured_at": "now"}
    monkeypatch.setattr("specrt.runtime.target.resolve",
                        lambda *a, **k: exactness.judge(record, "auto", "machine cache"))


PROMPT = [3, 4, 5, 3, 4, 5, 3, 4, 9, 12, 3, 4, 5]


def test_no_exact_mode_falls_back_to_plain_and_says_so(tiny_bundle, monkeypatch):
    _inexact(monkeypatch, tiny_bundle)
    gen = Generator(tiny_bundle, drafter="ngram", max_seq_len=64, slots=4)
    assert gen.drafter_name == "plain" and gen.slots == 1 and gen.requested_drafter == "ngram"
    assert any("not exact" in n and "running plain" in n for n in gen.notes)
    assert any("batching 4 sequences" in n for n in gen.notes)
    res = gen.generate_ids(PROMPT, 16)
    assert res.lossless and res.stats.drafted == 0  # plain batch-1 decoding: exact by definition

    risky = Generator(tiny_bundle, drafter="ngram", max_seq_len=64, allow_inexact=True)
    assert risky.drafter_name == "ngram" and not risky.notes
    res = risky.generate_ids(PROMPT, 16)
    assert res.stats.drafted > 0 and not res.lossless


def test_cli_reports_inexact_in_json_and_on_the_console(tiny_bundle, monkeypatch):
    _inexact(monkeypatch, tiny_bundle)
    runner = CliRunner()
    base = ["generate", str(tiny_bundle), "--prompt", "hi", "--max-new-tokens", "4", "--drafter", "ngram"]
    out = runner.invoke(cli, [*base, "--json", "--allow-inexact"])
    assert out.exit_code == 0, out.output
    body = json.loads(out.stdout)
    assert body["lossless"] is False and body["exactness"]["batch_invariant"] is False
    assert "no execution mode" in body["exactness"]["reason"]
    out = runner.invoke(cli, base)
    assert out.exit_code == 0 and "running plain decoding" in out.stderr
    body = json.loads(runner.invoke(cli, [*base, "--json"]).stdout)
    assert body["lossless"] is True and body["drafter"] == "plain"


def test_validate_fails_where_speculation_is_not_exact(tiny_bundle, monkeypatch):
    _inexact(monkeypatch, tiny_bundle)
    out = CliRunner().invoke(cli, ["validate", str(tiny_bundle), "--lossless", "--samples", "50", "--json"])
    assert out.exit_code == 1
    report = json.loads(out.stdout)
    assert report["verdict"] == "fail" and report["batch_invariant"] is False


def test_unknown_exec_mode_is_refused(tiny_bundle):
    out = CliRunner().invoke(cli, ["generate", str(tiny_bundle), "--prompt", "hi", "--exec-mode", "pad3"])
    assert out.exit_code != 0 and "pad3" in out.output
    with pytest.raises(Exception, match="pad3"):
        Generator(tiny_bundle, exec_mode="pad3")


@pytest.mark.parametrize("allow", [False, True])
def test_server_reports_exactness_in_models_and_metrics(tiny_bundle, monkeypatch, allow):
    import httpx

    from specrt.serving.api import create_app
    from specrt.serving.scheduler import Scheduler
    from specrt.tools.loadgen import loopback_server

    _inexact(monkeypatch, tiny_bundle)
    gen = Generator(tiny_bundle, drafter="ngram", max_seq_len=64, slots=4, allow_inexact=allow)
    with loopback_server(create_app(Scheduler(gen), "tiny")) as url:
        info = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["specrt"]
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert info["batch_invariant"] is False and "no execution mode" in info["reason"]
    assert info["lossless"] is (not allow)  # the fall-back (plain, one slot) is exact; allowing is not
    assert (info["drafter"], info["slots"]) == (("ngram", 4) if allow else ("plain", 1))
    assert f"specrt_lossless {0.0 if allow else 1.0}" in metrics
    assert 'specrt_exec_mode_info{batch_invariant="false",mode="direct"} 1.0' in metrics


def test_doctor_prints_simd_features_and_the_default_bundles_mode(tiny_bundle, home):
    from specrt.paths import default_bundle
    from specrt.runtime.machine import simd_features

    default_bundle().parent.mkdir(parents=True)
    default_bundle().symlink_to(tiny_bundle)
    out = CliRunner().invoke(cli, ["doctor"])
    assert out.exit_code == 0, out.output
    simd = next(line for line in out.output.splitlines() if line.startswith("simd"))
    assert f"AVX2:{'yes' if 'avx2' in simd_features() else 'no'}" in simd and "AVX-512 VNNI:" in simd and "AMX:" in simd
    line = next(line for line in out.output.splitlines() if line.startswith("exactness"))
    chosen = exactness.resolve(tiny_bundle, Manifest.load(tiny_bundle), 2).mode.name
    assert f"mode in use: {chosen} (exact)" in line and "direct" in line
