"""A store's answers saved alone and replayed on the native kernels: the rebuilt store is the distilled one
bit for bit (greedy and sampled answers, prompts and answers prefilled in chunks), it resumes, and a file
that is not whole is refused with one line before any native pass."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from click.testing import CliRunner

from specrt.cli import cli
from specrt.errors import SpecrtError
from specrt.export.training.answer_file import load_answers, save_answers
from specrt.export.training.corpus import load_prompts
from specrt.export.training.distill import build_store
from specrt.export.training.replay import replay_answers
from specrt.export.training.store import MappedData
from specrt.export.training.store_format import FIELDS

TAPS = (2, 15, 27)
NEW = 14


@pytest.fixture(scope="module")
def distilled(real_model, trained_int4_bundle, tmp_path_factory):
    """A native store: one held-out prompt and three training ones, greedy, then a sampled round."""
    rows = load_prompts()
    prompts = [r for r in rows if r["split"] == "heldout"][:1] + [r for r in rows if r["split"] == "train"][:3]
    root = tmp_path_factory.mktemp("distilled") / "store"
    build_store(real_model, prompts, root, 60, NEW, TAPS, precision="native", slots=2, progress=False,
                bundle=trained_int4_bundle)
    return root


def _by_job(root):
    data, meta = MappedData(root), json.loads((root / "meta.json").read_text())
    jobs = [j for s in meta["shards"] for j in s["jobs"]]
    return {j: ({f: data.fetch(f, i).numpy() for f in FIELDS}, int(data.prompt_lens[i]), bool(data.heldout[i]))
            for i, j in enumerate(jobs)}


def test_a_replayed_store_is_the_distilled_store_bit_for_bit(distilled, trained_int4_bundle, tmp_path):
    saved = save_answers(distilled, tmp_path / "answers.npz")
    answers = load_answers(tmp_path / "answers.npz")
    want = _by_job(distilled)
    assert saved["sequences"] == len(answers) == len(want)
    assert {j.split(":")[0] for j in want} == {"0", "1"}  # greedy and sampled answers
    shards = json.loads((distilled / "meta.json").read_text())["shards"]
    assert answers.answer_tokens == saved["answer_tokens"] == sum(s["answer_tokens"] for s in shards)
    with np.load(tmp_path / "answers.npz") as z:
        assert z["tokens"].dtype == np.uint16  # 49,152 ids fit
    # chunks of 8 rows: every prompt and answer spans several passes
    s = replay_answers(answers, tmp_path / "replayed", trained_int4_bundle, progress=False, chunk=8)
    assert s["made"] == len(want) and s["same_graph"] and s["greedy_argmax_is_stored_token"] == 1.0
    assert s["rows_per_second"] > 0 and s["left"] == 0
    got = _by_job(tmp_path / "replayed")
    assert got.keys() == want.keys()
    for job, (fields, prompt_len, heldout) in want.items():
        assert got[job][1:] == (prompt_len, heldout), job
        for name in FIELDS:
            assert np.array_equal(got[job][0][name], fields[name]), (job, name)
    meta = {p: json.loads((p / "meta.json").read_text()) for p in (distilled, tmp_path / "replayed")}
    assert meta[distilled]["key"] == meta[tmp_path / "replayed"]["key"]  # specrt distill can extend either
    assert meta[distilled]["prompts"] == meta[tmp_path / "replayed"]["prompts"]


def test_a_replay_resumes_where_it_stopped(distilled, trained_int4_bundle, tmp_path):
    save_answers(distilled, tmp_path / "a.npz")
    answers = load_answers(tmp_path / "a.npz")
    k = 2
    first = dataclasses.replace(answers, jobs=answers.jobs[:k], offsets=answers.offsets[: k + 1],
                                prompt_lens=answers.prompt_lens[:k], heldout=answers.heldout[:k])
    assert replay_answers(first, tmp_path / "s", trained_int4_bundle, progress=False)["made"] == k
    rest = replay_answers(answers, tmp_path / "s", trained_int4_bundle, progress=False)
    assert rest["made"] == len(answers) - k and rest["sequences"] == len(answers)
    assert replay_answers(answers, tmp_path / "s", trained_int4_bundle, progress=False)["made"] == 0
    assert _by_job(tmp_path / "s").keys() == set(answers.jobs)


def _rewrite(src, dst, **changes):
    with np.load(src) as z:
        arrays = {k: z[k] for k in z.files}
    arrays.update(changes)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    np.savez(dst, **arrays)


@pytest.mark.parametrize("change, says", [
    ({"offsets": "shift"}, "do not cover"),
    ({"prompt_lens": "long"}, "prompt length outside"),
    ({"jobs": None}, "has no array jobs"),
    ({"meta": "garbage"}, "does not parse"),
    ({"heldout": "short"}, "job ids but offsets"),
])
def test_a_damaged_answers_file_is_refused_with_its_name(distilled, tmp_path, change, says):
    save_answers(distilled, tmp_path / "a.npz")
    with np.load(tmp_path / "a.npz") as z:
        offsets, lens, heldout = z["offsets"], z["prompt_lens"], z["heldout"]
    values = {"shift": offsets + 1, "long": lens + 10_000, "garbage": np.frombuffer(b"{not json", np.uint8),
              "short": heldout[:-1], None: None}
    (name, what), = change.items()
    _rewrite(tmp_path / "a.npz", tmp_path / "bad.npz", **{name: values[what]})
    with pytest.raises(SpecrtError, match=says) as e:
        load_answers(tmp_path / "bad.npz")
    assert "bad.npz" in str(e.value) and "specrt answers save" in str(e.value)


def test_a_file_that_is_no_archive_or_holds_pickles_is_refused(distilled, tmp_path):
    (tmp_path / "x.npz").write_bytes(b"not a zip")
    with pytest.raises(SpecrtError, match="not a readable answers archive"):
        load_answers(tmp_path / "x.npz")
    save_answers(distilled, tmp_path / "a.npz")
    _rewrite(tmp_path / "a.npz", tmp_path / "p.npz", jobs=np.array([object()], dtype=object))
    with pytest.raises(SpecrtError, match="not a readable answers archive"):  # never unpickled
        load_answers(tmp_path / "p.npz")


def test_token_ids_past_the_targets_vocabulary_are_refused_before_a_pass(distilled, trained_int4_bundle, tmp_path):
    save_answers(distilled, tmp_path / "a.npz")
    answers = load_answers(tmp_path / "a.npz")
    tokens = answers.tokens.copy()
    tokens[3] = 60_000
    with pytest.raises(SpecrtError, match=r"outside 0\.\.49151"):
        replay_answers(dataclasses.replace(answers, tokens=tokens), tmp_path / "s", trained_int4_bundle, progress=False)
    assert not (tmp_path / "s").exists()


def test_the_cli_saves_and_replays(distilled, trained_int4_bundle, tmp_path):
    r = CliRunner().invoke(cli, ["answers", "save", str(distilled), "-o", str(tmp_path / "a.npz")])
    assert r.exit_code == 0 and "answer tokens" in r.output, r.output
    r = CliRunner().invoke(cli, ["answers", "replay", str(tmp_path / "a.npz"), "--target", str(trained_int4_bundle),
                                 "--store", str(tmp_path / "s")])
    assert r.exit_code == 0 and "answers replayed" in r.output and "note:" not in r.output, r.output
    assert json.loads((tmp_path / "s" / "runs.jsonl").read_text().splitlines()[-1])["same_graph"]
    r = CliRunner().invoke(cli, ["answers", "replay", str(tmp_path / "a.npz"), "--target", str(tmp_path),
                                 "--store", str(tmp_path / "t")])
    assert r.exit_code != 0 and "is not an exported bundle" in str(r.exception), r.output
    assert not (tmp_path / "t").exists()
