"""Distillation data at scale: the continuous-batching generator reproduces one-sequence-at-a-time
greedy answers and states, and the store is resumable, extendable, typed and never mixes settings."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specrt.errors import SpecrtError
from specrt.export.training.answers import Job, answer_jobs
from specrt.export.training.corpus import load_prompts
from specrt.export.training.datagen import encode, generate
from specrt.export.training.distill import build_store, jobs_for
from specrt.export.training.store import MappedData

TAPS = (2, 15, 27)


@pytest.fixture(scope="module")
def prompts():
    rows = load_prompts()
    return [r for r in rows if r["split"] == "heldout"][:2] + [r for r in rows if r["split"] == "train"][:3]


def test_batched_answers_equal_one_sequence_at_a_time(real_model, prompts):
    """Two slots for three prompts of different lengths: slots are refilled while the other decodes."""
    encoded = [encode(real_model, p["prompt"]) for p in prompts[:3]]
    done = {}
    answer_jobs(real_model.module, iter([Job(f"0:{i}", e, 0.0, False) for i, e in enumerate(encoded)]), 20, TAPS,
                lambda job, fields, n: done.__setitem__(job.id, fields), slots=2)
    want = generate(real_model.module, encoded, 20, TAPS, batch_size=1, progress=False)
    for i, (tokens, hidden, aux, top_ids, _) in enumerate(want):
        got = done[f"0:{i}"]
        assert got["tokens"].tolist() == tokens.tolist(), i
        np.testing.assert_allclose(got["hidden"].astype(np.float32), hidden.float().numpy(), atol=2e-2)
        np.testing.assert_allclose(got["aux"].astype(np.float32), aux.float().numpy(), atol=2e-2)
        assert (got["top_ids"][:, 0] == top_ids[:, 0].numpy()).mean() > 0.99


def test_the_store_resumes_extends_and_reads_back(real_model, prompts, tmp_path, monkeypatch):
    import specrt.export.training.distill as distill

    monkeypatch.setattr(distill, "SHARD_ROWS", 1)  # a shard per answer: resuming is per job
    root = tmp_path / "store"
    first = build_store(real_model, prompts, root, 30, 16, TAPS, slots=2, progress=False)
    meta = json.loads((root / "meta.json").read_text())
    jobs = [j for s in meta["shards"] for j in s["jobs"]]
    assert {f"0:{p['id']}" for p in prompts if p["split"] == "heldout"} <= set(jobs)  # held-out first, once
    assert first["train_answer_tokens"] >= 30
    (root / ".shard-00099.partial-1").mkdir()  # what an interrupted run leaves
    second = build_store(real_model, prompts, root, 120, 16, TAPS, slots=2, progress=False)
    meta2 = json.loads((root / "meta.json").read_text())
    jobs2 = [j for s in meta2["shards"] for j in s["jobs"]]
    assert jobs2[: len(jobs)] == jobs and len(set(jobs2)) == len(jobs2)  # kept, then only new jobs
    assert any(j.startswith("1:") for j in jobs2)  # a second (sampled) round over the training prompts
    assert second["train_answer_tokens"] >= 120 and not list(root.glob(".shard-*"))
    data = MappedData(root)
    assert len(data) == len(jobs2) and data.taps == TAPS
    heldout = {f"0:{p['id']}" for p in prompts if p["split"] == "heldout"}
    assert data.heldout.tolist() == [j in heldout for j in jobs2]
    i = jobs2.index(f"0:{prompts[2]['id']}")  # a greedy training answer: starts with its prompt
    prompt = encode(real_model, prompts[2]["prompt"])
    assert data.fetch("tokens", i)[: len(prompt)].tolist() == prompt and int(data.prompt_lens[i]) == len(prompt)
    assert data.fetch("hidden", i).dtype == torch.float16 and data.fetch("aux", i).shape[1] == 3 * 576
    with pytest.raises(SpecrtError, match="other settings"):
        build_store(real_model, prompts, root, 120, 32, TAPS, slots=2, progress=False)


def test_held_out_prompts_are_answered_once_greedily(real_model, prompts):
    jobs = jobs_for(real_model, prompts, 0.8, done=set())
    first = [next(jobs) for _ in range(2 + 3 * 3)]
    held = [j for j in first if j.heldout]
    assert len(held) == 2 and all(j.temperature == 0 for j in held)
    assert [j.temperature for j in first if not j.heldout] == [0.0] * 3 + [0.8] * 6
    assert len({j.seed for j in first}) == len(first)
