"""Distillation data at scale: the continuous-batching generator reproduces one-sequence-at-a-time
greedy answers and states, and the store is resumable, extendable, typed and never mixes settings."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specrt.errors import SpecrtError
from specrt.export.training.answers import Job, answer_jobs, batch_tolerance, quantized
from specrt.export.training.corpus import load_prompts
from specrt.export.training.datagen import encode, generate
from specrt.export.training.distill import build_store, jobs_for
from specrt.export.training.precision import engine_in_use, quant_engine
from specrt.export.training.store import MappedData

TAPS = (2, 15, 27)


@pytest.fixture(scope="module")
def prompts():
    rows = load_prompts()
    return [r for r in rows if r["split"] == "heldout"][:2] + [r for r in rows if r["split"] == "train"][:3]


def _batched_and_alone(module, encoded: list[list[int]], taps, new_tokens: int) -> list[tuple[dict, tuple]]:
    """Each prompt's fields from two slots (refilled while the other decodes) beside the same prompt
    generated one sequence at a time."""
    done = {}
    answer_jobs(module, iter([Job(f"0:{i}", e, 0.0, False) for i, e in enumerate(encoded)]), new_tokens, taps,
                lambda job, fields, n: done.__setitem__(job.id, fields), slots=2)
    want = generate(module, encoded, new_tokens, taps, batch_size=1, progress=False)
    return [(done[f"0:{i}"], w) for i, w in enumerate(want)]


def _assert_rows_close(name: str, got: np.ndarray, want: np.ndarray, tol: tuple[float, float]) -> None:
    """Rows within `batch_tolerance`: rtol of |x| (fp16 storage) plus a share of the row's largest |x|."""
    assert got.shape == want.shape, (name, got.shape, want.shape)
    rtol, share = tol
    bound = rtol * np.abs(want) + share * np.abs(want).max(axis=-1, keepdims=True)
    diff = np.abs(got.astype(np.float32) - want)
    worst = np.unravel_index(np.argmax(diff - bound), diff.shape)
    assert (diff <= bound).all(), (f"{name}: |Δ| {diff[worst]:.4g} at {want[worst]:.4g} > bound {bound[worst]:.4g} "
                                   f"(rtol {rtol:.3g}, {share:.3g} of the row's max |x|)")


def test_batched_answers_equal_one_sequence_at_a_time(real_model, prompts):
    """Two slots for three prompts of different lengths, fp32 (what `answer_jobs` runs unquantized):
    the same tokens, and states within the fp32 branch's derived bound (answers.batch_tolerance)."""
    cfg = real_model.module.cfg
    tol = batch_tolerance("fp32", cfg.num_layers, max(cfg.hidden_size, cfg.intermediate_size))
    encoded = [encode(real_model, p["prompt"]) for p in prompts[:3]]
    for i, (got, (tokens, hidden, aux, top_ids, _)) in enumerate(_batched_and_alone(real_model.module, encoded,
                                                                                    TAPS, 20)):
        assert got["tokens"].tolist() == tokens.tolist(), i
        _assert_rows_close(f"{i} hidden", got["hidden"], hidden.float().numpy(), tol)
        _assert_rows_close(f"{i} aux", got["aux"], aux.float().numpy(), tol)
        assert (got["top_ids"][:, 0] == top_ids[:, 0].numpy()).mean() > 0.99


@pytest.fixture(scope="module")
def tiny_target():
    from specrt.export.loading import module_from_hf
    from tests.helpers import tiny_hf_model

    return module_from_hf(tiny_hf_model("llama", seed=3))


ENGINES = [e for e in torch.backends.quantized.supported_engines if e != "none"]
BRANCHES = [("fp32", None)] + [("int8", e) for e in ENGINES]


@pytest.mark.parametrize("precision,engine", BRANCHES, ids=[f"{p}-{e}" if e else p for p, e in BRANCHES])
def test_batched_answers_match_one_at_a_time_in_every_branch(tiny_target, precision, engine):
    """Every compute branch distillation can run here (fp32; int8 with each engine this torch has), on a
    tiny target: the same greedy tokens, states within that branch's derived bound."""
    target, cfg = tiny_target, tiny_target.cfg
    tol = batch_tolerance(precision, cfg.num_layers, max(cfg.hidden_size, cfg.intermediate_size))
    g = torch.Generator().manual_seed(0)
    encoded = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 7)]
    with engine_in_use(engine or torch.backends.quantized.engine):
        module = quantized(target, precision)
        pairs = _batched_and_alone(module, encoded, (0, 1), 12)
    for i, (got, (tokens, hidden, aux, _, _)) in enumerate(pairs):
        assert got["tokens"].tolist() == tokens.tolist(), i
        _assert_rows_close(f"{i} hidden", got["hidden"], hidden.float().numpy(), tol)
        _assert_rows_close(f"{i} aux", got["aux"], aux.float().numpy(), tol)


def test_the_quantized_engine_is_forced_and_recorded(monkeypatch):
    monkeypatch.delenv("SPECRT_QUANT_ENGINE", raising=False)
    engine, record = quant_engine("auto")
    assert engine == torch.backends.quantized.engine and record["forced"] is False
    for name in ENGINES:
        monkeypatch.setenv("SPECRT_QUANT_ENGINE", name)
        assert quant_engine("auto") == (name, {"value": name, "forced": True, "chosen_by": "SPECRT_QUANT_ENGINE"})
    with pytest.raises(SpecrtError, match="SPECRT_QUANT_ENGINE='int4'"):
        monkeypatch.setenv("SPECRT_QUANT_ENGINE", "int4")
        quant_engine("auto")
    before = torch.backends.quantized.engine
    with engine_in_use(ENGINES[-1]):
        assert torch.backends.quantized.engine == ENGINES[-1]
    assert torch.backends.quantized.engine == before


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
    with pytest.raises(SpecrtError, match=r"other settings \(max_new_tokens 16 → 32\); remove it"):
        build_store(real_model, prompts, root, 120, 32, TAPS, slots=2, progress=False)


def test_held_out_prompts_are_answered_once_greedily(real_model, prompts):
    jobs = jobs_for(real_model, prompts, 0.8, done=set())
    first = [next(jobs) for _ in range(2 + 3 * 3)]
    held = [j for j in first if j.heldout]
    assert len(held) == 2 and all(j.temperature == 0 for j in held)
    assert [j.temperature for j in first if not j.heldout] == [0.0] * 3 + [0.8] * 6
    assert len({j.seed for j in first}) == len(first)
