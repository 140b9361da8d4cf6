"""Each backend is a reference of its own, and specrt says which one an output is exact to.

- `specrt generate --json` names it in `exactness.exact_to` (backend, graph, precision, exec mode),
  `ort-fused` included, and the sampling form; null where the output is not lossless;
- `/v1/models` says the same for the served model;
- `specrt bench` says what each engine's `identical` column is held to, and a peer whose plain output
  differs from specrt's plain while it is another specrt reference (another backend, mode or bundle)
  is "a different reference (d/n differ)", not a failed identity; a peer of the *same* reference that
  differs still shows the plain k/n mismatch.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
from click.testing import CliRunner

from specrt.cli import cli
from specrt.runtime.generate import Generator
from specrt.runtime.reference import Reference, same_reference
from specrt.tools.bench import Prompt, format_table, run_bench, summarize
from specrt.tools.report import engines_section
from tests.helpers import built_copy

PROMPTS = [Prompt("a", "code", "a b c a b c a b c a b"), Prompt("b", "chat", "one two one two one two")]


@pytest.fixture(scope="module")
def built(tiny_bundle, tmp_path_factory):
    """A copy of the tiny bundle after `specrt build`'s ONNX Runtime step (it writes the ort-fused graphs)."""
    return built_copy(tiny_bundle, tmp_path_factory.mktemp("refs") / "bundle")


def generate_json(bundle, *extra) -> dict:
    result = CliRunner().invoke(cli, ["generate", str(bundle), "--prompt", "a b c a b c", "--raw", "--json",
                                      "--max-new-tokens", "8", "--max-seq-len", "64", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


@pytest.mark.parametrize("backend, graph", [("ort", "target/decoder.ort-opt.onnx"),  # `specrt build` wrote both
                                            ("ort-fused", "target/decoder.ort-fused.onnx")])
def test_generate_json_names_the_reference(built, backend, graph):
    from specrt.engines.registry import graph_path
    from specrt.schema.manifest import Manifest

    assert graph_path(backend, built, Manifest.load(built), "target") == built / graph  # the graph it runs
    out = generate_json(built, "--drafter", "ngram", "--backend", backend)
    assert out["lossless"] is True
    ref = out["exactness"]["exact_to"]
    mode = out["exactness"]["mode"]
    assert {k: ref[k] for k in ("decoding", "backend", "graph", "precision", "exec_mode")} == \
        {"decoding": "plain greedy", "backend": backend, "graph": graph, "precision": "fp32", "exec_mode": mode}
    assert ref["text"] == f"plain greedy decoding of {graph} (fp32) on backend {backend}, exec mode {mode}"


def test_generate_json_sampling_names_the_distribution(built):
    ref = generate_json(built, "--temperature", "0.8", "--seed", "1")["exactness"]["exact_to"]
    assert ref["decoding"] == "plain sampling" and ref["text"].startswith("the distribution of plain sampling of")


def test_exact_to_is_null_where_the_output_is_not_lossless(built):
    from specrt.cli.generate_cmd import exactness_summary

    gen = Generator(built, max_seq_len=64)
    assert exactness_summary(gen, SimpleNamespace(lossless=True))["exact_to"] == gen.reference.to_dict()
    assert exactness_summary(gen, SimpleNamespace(lossless=False))["exact_to"] is None


def test_two_backends_are_two_references(built):
    ort = Generator(built, max_seq_len=64).reference
    fused = Generator(built, max_seq_len=64, backend="ort-fused").reference
    assert isinstance(ort, Reference) and ort.target_digest == fused.target_digest  # the same weights
    assert not same_reference(ort.to_dict(), fused.to_dict())
    assert same_reference(ort.to_dict(), Generator(built, max_seq_len=64).reference.to_dict())
    assert same_reference(ort.to_dict(), None) is None


def test_v1_models_names_the_reference(built):
    from specrt.serving.api import create_app
    from specrt.serving.scheduler import Scheduler
    from specrt.tools.loadgen import loopback_server

    gen = Generator(built, drafter="plain", max_seq_len=64, backend="ort-fused")
    with loopback_server(create_app(Scheduler(gen), "tiny")) as url:
        info = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["specrt"]
    assert info["lossless"] is True and info["exact_to"] == gen.reference.to_dict()
    assert info["exact_to"]["backend"] == "ort-fused" and "on backend ort-fused" in info["exact_to"]["text"]


# ── bench ─────────────────────────────────────────────────────────────────────────────────────────

def bench_row(drafter, pid, peer=False, reference="plain", identical=True, same=None):
    r = {"drafter": drafter, "id": pid, "category": "code", "tokens_per_s": 10.0, "peer": peer,
         "reference": reference, "identical_to_plain": identical, "mean_accepted_len": None if peer else 1.0,
         "steps": 0, "accepted_per_position": []}
    if peer:
        r["same_as_specrt_plain"] = same
    return r


ORT = {"decoding": "plain greedy", "backend": "ort", "graph": "target/decoder.onnx", "precision": "int4",
       "exec_mode": "pad2", "target_digest": "d", "text": "plain greedy decoding of target/decoder.onnx (int4) on "
       "backend ort, exec mode pad2"}
FUSED = {**ORT, "backend": "ort-fused", "graph": "target/decoder.ort-fused.onnx",
         "text": "plain greedy decoding of target/decoder.ort-fused.onnx (int4) on backend ort-fused, exec mode pad2"}


def fused_rows():
    """Three prompts; ort-fused's plain output differs from ort's on two; its ngram equals its own plain."""
    rows = []
    for pid, same in (("a", True), ("b", False), ("c", False)):
        rows += [bench_row("plain", pid), bench_row("ngram", pid),
                 bench_row("specrt-ort-fused-plain", pid, True, None, None, same),
                 bench_row("specrt-ort-fused-ngram", pid, True, "specrt-ort-fused-plain", True, same)]
    return rows


def test_a_backend_with_other_plain_output_is_a_different_reference():
    s = summarize(fused_rows(), references={"plain": ORT, "specrt-ort-fused-plain": FUSED})
    fused, spec = s["specrt-ort-fused-plain"], s["specrt-ort-fused-ngram"]
    assert fused["same_as_specrt_plain"] == "different reference (2/3 differ)" and fused["different_reference"]
    assert fused["prompts_differing"] == 2 and fused["identical"] == "reference"
    assert (spec["identical"], spec["held_to"], spec["held_to_is"]) == ("3/3", "specrt-ort-fused-plain", FUSED["text"])
    assert spec["same_as_specrt_plain"] == "different reference (2/3 differ)"
    assert (s["ngram"]["held_to"], s["ngram"]["held_to_is"]) == ("plain", ORT["text"])
    table = format_table(s)
    assert "different reference (2/3 differ)" in table and f"reference plain = {ORT['text']}" in table
    assert f"reference specrt-ort-fused-plain = {FUSED['text']}" in table
    assert ("specrt-ort-fused-plain is a different reference from plain: its plain output differs from plain's "
            "on 2 prompt(s)") in table
    report = engines_section({"summary": s, "config": {"peers": ["specrt-ort-fused-plain"]}, "rows": fused_rows()})
    assert "different reference (2/3 differ)" in report and f"`specrt-ort-fused-plain`: {FUSED['text']}" in report


def test_the_same_reference_that_differs_is_still_a_mismatch():
    s = summarize(fused_rows(), references={"plain": ORT, "specrt-ort-fused-plain": {**ORT}})
    assert s["specrt-ort-fused-plain"]["same_as_specrt_plain"] == "1/3"
    assert "different_reference" not in s["specrt-ort-fused-plain"]
    unknown = summarize(fused_rows())  # no references known: the plain counts, as before
    assert unknown["specrt-ort-fused-plain"]["same_as_specrt_plain"] == "1/3"


def test_bench_backend_baseline_records_each_reference(built):
    from specrt.tools.peers import variant_peers

    peers = variant_peers(built, "ort-fused", ["ngram"], 2, 64, in_process=True, backend="ort-fused")
    gen = Generator(built, max_seq_len=64)
    res = run_bench(gen, PROMPTS, ["ngram"], 12, peers=peers, raw=True, progress=False, cooldown=0)
    refs = res["config"]["references"]
    assert refs["plain"] == gen.reference.to_dict() and refs["specrt-ort-fused-plain"]["backend"] == "ort-fused"
    s = res["summary"]
    assert s["ngram"]["held_to_is"] == refs["plain"]["text"] and s["specrt-ort-fused-ngram"]["identical"] == "2/2"
    assert s["specrt-ort-fused-ngram"]["held_to_is"] == refs["specrt-ort-fused-plain"]["text"]
    rows = [r for r in res["rows"] if r["drafter"] == "specrt-ort-fused-plain"]
    differ = sum(not r["same_as_specrt_plain"] for r in rows)
    expected = f"different reference ({differ}/2 differ)" if differ else "2/2"
    assert s["specrt-ort-fused-plain"]["same_as_specrt_plain"] == expected


def test_v1_models_exact_to_is_null_when_speculating_inexactly(tiny_bundle, monkeypatch):
    from specrt.serving.api import create_app
    from specrt.serving.scheduler import Scheduler
    from specrt.tools.loadgen import loopback_server
    from tests.runtime.test_exactness import _inexact

    _inexact(monkeypatch, tiny_bundle)  # no mode is exact here, and --allow-inexact speculates anyway
    gen = Generator(tiny_bundle, drafter="ngram", max_seq_len=64, allow_inexact=True)
    with loopback_server(create_app(Scheduler(gen), "tiny")) as url:
        info = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["specrt"]
    assert info["lossless"] is False and info["exact_to"] is None
