"""A distillation store is checked against its meta.json before it is extended (`specrt distill`) or
trained on (`MappedData`, `specrt train --store`): a truncated, missing or retyped shard file, or a
meta.json that does not parse, is refused with one line naming the shard and the file; a healthy
store still resumes. Stores here are written through the ShardWriter with tiny arrays (no model)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

import specrt.export.training.distill as distill
from specrt.errors import SpecrtError
from specrt.export.training.distill import build_store, prompt_digests, store_key
from specrt.export.training.store import MappedData, ShardWriter

TAPS, HIDDEN, TOPK, MAX_NEW = (0, 1), 8, 4, 6
PROMPTS = [{"id": "h0", "split": "heldout", "prompt": "held out"}] + \
    [{"id": f"t{i}", "split": "train", "prompt": f"train {i}"} for i in range(3)]
PROMPT_IDS = [5, 6, 7]


def fields(rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, 100, rows, dtype=np.int32),
            "hidden": rng.standard_normal((rows, HIDDEN)).astype(np.float16),
            "aux": rng.standard_normal((rows, len(TAPS) * HIDDEN)).astype(np.float16),
            "top_ids": rng.integers(0, 100, (rows, TOPK), dtype=np.int32),
            "top_p": rng.random((rows, TOPK)).astype(np.float16)}


@pytest.fixture
def loaded(tmp_path):
    """Only what `store_key` reads of a loaded model (generation is replaced by `fake_generation`)."""
    source = tmp_path / "model.gguf"
    source.write_bytes(b"weights")
    return SimpleNamespace(source=str(source), module=None)


def key(loaded) -> dict:
    return store_key(loaded, MAX_NEW, TAPS, 0.8, "int8")


@pytest.fixture
def store(tmp_path, loaded) -> Path:
    """Two shards: the held-out answer and one training answer, then two more training answers."""
    root = tmp_path / "store"
    writer = ShardWriter(root, TAPS, key(loaded), prompt_digests(PROMPTS))
    for shard, jobs in enumerate([["0:h0", "0:t0"], ["0:t1", "0:t2"]]):
        for j, job in enumerate(jobs):
            writer.add(job, fields(len(PROMPT_IDS) + 4, 10 * shard + j), len(PROMPT_IDS), job == "0:h0")
        writer.flush()
    return root


@pytest.fixture
def fake_generation(monkeypatch):
    """Each job answered with 4 tokens, no model; records the jobs asked for."""
    asked = []

    def answer_jobs(module, jobs, max_new_tokens, taps, on_done, slots, stop, progress):
        made = 0
        for job in jobs:
            if stop():
                break
            asked.append(job.id)
            on_done(job, fields(len(job.prompt) + 4, len(asked)), len(job.prompt))
            made += 4
        return made

    monkeypatch.setattr(distill, "encode", lambda loaded, text: list(PROMPT_IDS))
    monkeypatch.setattr(distill, "quantized", lambda module, precision: module)
    monkeypatch.setattr(distill, "answer_jobs", answer_jobs)
    monkeypatch.setattr(distill, "SHARD_ROWS", 1)
    return asked


def truncate(path: Path, by: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - by])


def damage_aux(root: Path) -> str:
    truncate(root / "shard-00001" / "aux.npy", 8)
    return r"shard-00001/aux\.npy is \d+ bytes, its header says \d+ \(truncated\)"


def damage_tokens(root: Path) -> str:
    (root / "shard-00000" / "tokens.npy").unlink()
    return r"shard-00000/tokens\.npy is missing"


def damage_meta(root: Path) -> str:
    truncate(root / "meta.json", 20)
    return r"meta\.json does not parse"


def damage_dtype(root: Path) -> str:
    path = root / "shard-00001" / "tokens.npy"
    np.save(path, np.load(path).astype(np.int64))  # same values and rows, another dtype
    return r"shard-00001/tokens\.npy holds int64, the store writes int32"


def damage_rows(root: Path) -> str:
    path = root / "shard-00000" / "hidden.npy"
    np.save(path, np.load(path)[:-1])  # a whole file, one row short of meta.json's count
    return r"shard-00000/hidden\.npy has shape \[13, 8\], meta\.json implies \[14, '\*'\]"


def damage_folder(root: Path) -> str:
    for f in (root / "shard-00001").iterdir():
        f.unlink()
    (root / "shard-00001").rmdir()
    return r"shard-00001 is missing"


DAMAGES = [damage_aux, damage_tokens, damage_meta, damage_dtype, damage_rows, damage_folder]


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__)
def test_a_damaged_store_is_neither_extended_nor_trained_on(store, loaded, fake_generation, damage):
    pattern = damage(store)
    before = sorted(p.name for p in store.iterdir())
    with pytest.raises(SpecrtError, match=pattern) as refused:
        build_store(loaded, PROMPTS, store, 100, MAX_NEW, TAPS, progress=False)
    message = str(refused.value)
    assert "\n" not in message and "--store NEW_FOLDER" in message
    assert fake_generation == [] and sorted(p.name for p in store.iterdir()) == before  # nothing added
    with pytest.raises(SpecrtError, match=pattern):
        MappedData(store)


def test_the_refusal_says_which_shard_folder_and_entry_to_delete(store):
    damage_aux(store)
    with pytest.raises(SpecrtError, match=rf"delete the folder {store / 'shard-00001'} and its entry in "
                                          rf"{store / 'meta.json'}"):
        MappedData(store)


def test_train_store_refuses_a_damaged_store_in_one_line_before_loading_the_model(store, monkeypatch):
    from specrt.cli import cli
    from specrt.export import loading

    damage_aux(store)
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model was loaded first"))
    result = CliRunner().invoke(cli, ["train", "eagle", "--store", str(store)], standalone_mode=False)
    assert isinstance(result.exception, SpecrtError)
    assert "shard-00001/aux.npy" in str(result.exception) and "truncated" in str(result.exception)


def test_a_healthy_store_resumes_and_reads_back(store, loaded, fake_generation):
    summary = build_store(loaded, PROMPTS, store, 20, MAX_NEW, TAPS, progress=False)
    assert summary["had_answer_tokens"] == 16 and fake_generation == ["1:t0", "1:t1"]  # round 0 is held
    meta = json.loads((store / "meta.json").read_text())
    assert [s["name"] for s in meta["shards"]] == [f"shard-{i:05d}" for i in range(len(meta["shards"]))]
    data = MappedData(store)
    assert len(data) == 4 + len(fake_generation) and data.heldout.tolist()[:2] == [True, False]
    assert data.fetch("tokens", 1).tolist() == fields(7, 1)["tokens"].tolist()


def test_a_shard_renamed_but_never_listed_is_removed_and_its_jobs_made_again(store, loaded, fake_generation):
    """What a run stopped between renaming a shard and replacing meta.json leaves behind."""
    orphan = store / "shard-00002"
    orphan.mkdir()
    (orphan / "tokens.npy").write_bytes(b"half")
    build_store(loaded, PROMPTS, store, 16, MAX_NEW, TAPS, progress=False)
    meta = json.loads((store / "meta.json").read_text())
    assert meta["shards"][2]["name"] == "shard-00002" and meta["shards"][2]["jobs"] == ["1:t0"]
    assert len(MappedData(store)) == 5


def test_after_deleting_a_shard_and_its_entry_distill_goes_on(store, loaded, fake_generation):
    """The fix the refusal names: its jobs are made again, into a shard named after the last listed one
    (never over a shard that is still there)."""
    meta = json.loads((store / "meta.json").read_text())
    removed = meta["shards"].pop(0)
    for f in (store / removed["name"]).iterdir():
        f.unlink()
    (store / removed["name"]).rmdir()
    (store / "meta.json").write_text(json.dumps(meta))
    build_store(loaded, PROMPTS, store, 12, MAX_NEW, TAPS, progress=False)
    names = [s["name"] for s in json.loads((store / "meta.json").read_text())["shards"]]
    assert names == ["shard-00001", "shard-00002", "shard-00003"] and fake_generation == ["0:h0", "0:t0"]
    assert len(MappedData(store)) == 4


def test_no_meta_json_beside_shard_folders_is_refused_not_overwritten(store, loaded, fake_generation):
    (store / "meta.json").unlink()
    with pytest.raises(SpecrtError, match=r"meta\.json is missing, yet shard folders are there"):
        build_store(loaded, PROMPTS, store, 12, MAX_NEW, TAPS, progress=False)
    assert (store / "shard-00000" / "tokens.npy").is_file()


def test_a_grown_corpus_extends_the_store_its_new_prompts_first(store, loaded, fake_generation):
    """New ids anywhere in the list (not only appended) join the store; round 0 answers them before any
    later round, and every id the store answered keeps its jobs."""
    new = [{"id": "n0", "split": "train", "prompt": "new 0"}, {"id": "h1", "split": "heldout", "prompt": "new held"}]
    grown = PROMPTS[:2] + new + PROMPTS[2:]
    build_store(loaded, grown, store, 20, MAX_NEW, TAPS, progress=False)
    assert fake_generation == ["0:h1", "0:n0", "1:t0"]  # the new held-out prompt first, then new training ones
    meta = json.loads((store / "meta.json").read_text())
    assert meta["prompts"] == prompt_digests(grown)
    assert MappedData(store).heldout.tolist() == [True, False, False, False, True, False, False]


def test_an_answered_prompt_whose_text_or_split_changed_is_refused_by_id(store, loaded, fake_generation):
    before = (store / "meta.json").read_text()
    for changed in ({**PROMPTS[1], "prompt": "train zero, edited"}, {**PROMPTS[1], "split": "heldout"}):
        rows = [PROMPTS[0], changed, *PROMPTS[2:]]
        with pytest.raises(SpecrtError, match=r"has answered prompt id\(s\) t0 with another text or split: give a "
                                              r"changed prompt a new id"):
            build_store(loaded, rows, store, 100, MAX_NEW, TAPS, progress=False)
    assert fake_generation == [] and (store / "meta.json").read_text() == before
    unanswered = [*PROMPTS, {"id": "n0", "split": "train", "prompt": "new 0"}]
    build_store(loaded, unanswered, store, 12, MAX_NEW, TAPS, progress=False)  # n0 recorded, not answered yet
    unanswered[-1] = {**unanswered[-1], "prompt": "new 0, edited"}
    build_store(loaded, unanswered, store, 12, MAX_NEW, TAPS, progress=False)  # so it may still change
    assert json.loads((store / "meta.json").read_text())["prompts"]["n0"] == prompt_digests(unanswered)["n0"]


def whole_list_store(store: Path, rows: list[dict]) -> None:
    """The store as an earlier specrt keyed it: one digest of its whole prompt list, no per-id digests."""
    import hashlib

    meta = json.loads((store / "meta.json").read_text())
    text = "\n".join(f"{p['split']}\t{p['prompt']}" for p in rows)
    meta["key"]["prompts"] = hashlib.sha256(text.encode()).hexdigest()[:16]
    del meta["prompts"]
    (store / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("listed", ["the same list", "answered part"])
def test_a_store_keyed_by_its_whole_prompt_list_is_upgraded_then_grows(store, loaded, fake_generation, listed):
    old = PROMPTS + [{"id": "t3", "split": "train", "prompt": "train 3"}]  # t3 never answered
    whole_list_store(store, PROMPTS if listed == "answered part" else old)
    grown = [{"id": "n0", "split": "train", "prompt": "new 0"}, *old]
    if listed == "the same list":  # upgraded by a run with its own list, then grown
        build_store(loaded, old, store, 12, MAX_NEW, TAPS, progress=False)
        assert fake_generation == []
    build_store(loaded, grown, store, 20, MAX_NEW, TAPS, progress=False)
    assert fake_generation == ["0:n0", "0:t3"]
    meta = json.loads((store / "meta.json").read_text())
    assert "prompts" not in meta["key"] and meta["prompts"] == prompt_digests(grown)


def test_a_whole_list_store_for_other_prompts_is_refused_with_the_way_to_upgrade(store, loaded, fake_generation):
    whole_list_store(store, PROMPTS)
    before = (store / "meta.json").read_text()
    other = [{**PROMPTS[0], "prompt": "another held out"}, *PROMPTS[1:]]
    with pytest.raises(SpecrtError, match=r"written by an earlier specrt for one whole prompt list.*run specrt "
                                          r"distill once with the --prompts it was built from"):
        build_store(loaded, other, store, 100, MAX_NEW, TAPS, progress=False)
    assert fake_generation == [] and (store / "meta.json").read_text() == before
