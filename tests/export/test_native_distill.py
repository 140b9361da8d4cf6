"""Distillation on the native kernels: the bundle's int4 target answers the prompts in batched slots, each
slot's rows bitwise what the same job answered alone gives, its greedy answers the runtime's own plain
output, and the store keyed to the graph it came from; the options that backend does not take are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from specrt.cli import cli
from specrt.export.training.answers import MAX_PROMPT, Job, answer_jobs
from specrt.export.training.corpus import load_prompts
from specrt.export.training.datagen import encode
from specrt.export.training.distill import build_store
from specrt.export.training.native_answers import NativePasses
from specrt.export.training.store import MappedData
from specrt.runtime.generate import Generator

TAPS = (2, 15, 27)
NEW = 14


@pytest.fixture(scope="module")
def prompts():
    rows = load_prompts()
    return [r for r in rows if r["split"] == "heldout"][:1] + [r for r in rows if r["split"] == "train"][:3]


def _answers(bundle, encoded, slots, temperature=0.0):
    passes = NativePasses(bundle, slots, MAX_PROMPT + NEW + 1, TAPS, threads=2)
    done = {}
    jobs = [Job(f"1:{i}", e, temperature, False) for i, e in enumerate(encoded)]
    answer_jobs(passes, iter(jobs), NEW, TAPS, lambda job, fields, n: done.__setitem__(job.id, fields), slots=slots)
    return [done[j.id] for j in jobs]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batched_native_answers_are_bitwise_the_jobs_answered_alone(real_model, trained_int4_bundle, prompts,
                                                                   temperature):
    """Two slots for four prompts of different lengths (refilled while the other slot decodes) against one
    slot: every field equal bit for bit, sampled answers included (each job has its own seed)."""
    encoded = [encode(real_model, p["prompt"]) for p in prompts]
    assert len({len(e) for e in encoded}) > 1
    batched, alone = _answers(trained_int4_bundle, encoded, 2, temperature), _answers(trained_int4_bundle, encoded, 1,
                                                                                      temperature)
    for i, (got, want) in enumerate(zip(batched, alone, strict=True)):
        assert len(got["tokens"]) == len(encoded[i]) + NEW - 1, i  # the last token is never fed
        for name in ("tokens", "hidden", "aux", "top_ids", "top_p"):
            assert np.array_equal(got[name], want[name]), (i, name)
        assert got["aux"].shape[1] == len(TAPS) * real_model.module.cfg.hidden_size


def test_greedy_native_answers_are_the_runtimes_plain_output(real_model, trained_int4_bundle, prompts):
    """The store's answers are what the runtime's target says: the native plain generator's greedy tokens,
    and the states it would hand a drafter (hidden, taps) are the target pass's."""
    encoded = [encode(real_model, p["prompt"]) for p in prompts[:2]]
    gen = Generator(trained_int4_bundle, "plain", max_seq_len=256, backend="native")
    got = _answers(trained_int4_bundle, encoded, 2)
    for e, fields in zip(encoded, got, strict=True):
        want = gen.generate_ids(e, NEW).token_ids
        answer = fields["tokens"][len(e):].tolist() + [int(fields["top_ids"][-1, 0])]
        assert answer == want[: len(answer)]
        assert fields["top_ids"][len(e) - 1 : -1, 0].tolist() == fields["tokens"][len(e):].tolist()  # greedy
    one = NativePasses(trained_int4_bundle, 1, 64, TAPS, threads=2)
    full = one.decoder.run_all(np.asarray([encoded[0]]), np.arange(len(encoded[0]))[None], np.zeros(1, np.int64),
                               np.tril(np.ones((len(encoded[0]),) * 2, bool))[None],
                               np.arange(len(encoded[0]))[None])
    assert np.array_equal(full["hidden_states"][0].astype(np.float16), got[0]["hidden"][: len(encoded[0])])


def test_native_store_is_keyed_to_its_graph_and_resumes(real_model, trained_int4_bundle, prompts, tmp_path):
    root = tmp_path / "store"
    first = build_store(real_model, prompts, root, 20, NEW, TAPS, precision="native", slots=2, progress=False,
                        bundle=trained_int4_bundle)
    meta = json.loads((root / "meta.json").read_text())
    want = json.loads((trained_int4_bundle / "manifest.json").read_text())["graphs"]["target"]["sha256"]
    assert meta["key"]["precision"] == "native" and meta["key"]["features"] == {"graph": "target", "sha256": want}
    assert "native_kernel" in first["branches"]
    data = MappedData(root)
    assert data.heldout.tolist()[0] and data.has_aux
    second = build_store(real_model, prompts, root, 60, NEW, TAPS, precision="native", slots=2, progress=False,
                         bundle=trained_int4_bundle)
    assert second["had_answer_tokens"] == first["answer_tokens"] < second["answer_tokens"]
    assert len(MappedData(root)) > len(data)


@pytest.mark.parametrize("extra, says", [
    (["--precision", "fp32"], "--precision sets the torch backend"),
    (["--quant-engine", "x86"], "--quant-engine sets the torch backend"),
    (["--features-from", "BUNDLE"], "--features-from recomputes"),
])
def test_native_distill_refuses_what_it_does_not_honour(trained_int4_bundle, tmp_path, extra, says):
    args = [a.replace("BUNDLE", str(trained_int4_bundle)) for a in extra]
    r = CliRunner().invoke(cli, ["distill", "--backend", "native", "--target", str(trained_int4_bundle), "--store",
                                 str(tmp_path / "s"), *args])
    assert r.exit_code != 0 and says in f"{r.output}{r.exception}", r.output
    assert not (tmp_path / "s").exists()


def test_native_distill_needs_a_bundle(default_gguf, tmp_path):
    r = CliRunner().invoke(cli, ["distill", "--backend", "native", "--target", str(default_gguf), "--store",
                                 str(tmp_path / "s")])
    assert r.exit_code != 0 and "pass --target BUNDLE" in f"{r.output}{r.exception}", r.output


def test_corpora_join_and_refuse_a_shared_id(tmp_path):
    from specrt.errors import SpecrtError
    from specrt.export.training.corpus import load_corpora

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"id": "x1", "prompt": "one"}\n{"id": "x2", "prompt": "two", "split": "heldout"}\n')
    b.write_text('{"id": "y1", "prompt": "three"}\n')
    assert [r["id"] for r in load_corpora([a, b])] == ["x1", "x2", "y1"]
    assert load_corpora([]) == load_prompts()
    b.write_text('{"id": "x2", "prompt": "again"}\n')
    with pytest.raises(SpecrtError, match=r"'x2' is in both .*a\.jsonl and .*b\.jsonl"):
        load_corpora([a, b])
