"""`specrt distill`: build (or extend) a distillation store until it holds a budget of answer tokens.

Jobs, in order: every held-out prompt once, greedy (the evaluation set); then rounds over the
training prompts, round 0 greedy and each later round sampled at `temperature` with a seed of its
own, so one prompt yields several distinct answers. Job ids are "ROUND:PROMPT_ID": a rerun skips
the jobs the store already holds and goes on where the last run stopped, and a larger budget
extends the same store. A grown corpus extends it too: its new prompts are answered first (round 0
is the first round with jobs left). Prompts come from the shipped corpus or the user's JSONL; the held-out
split is never trained on.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from specrt.errors import SpecrtError
from specrt.export.loading import LoadedModel
from specrt.export.training.answers import MAX_PROMPT, Job, answer_jobs, quantized
from specrt.export.training.datagen import encode
from specrt.export.training.precision import aten_dispatch, engine_in_use, quant_engine
from specrt.export.training.store import MappedData, ShardWriter, answered_ids, forget_whole_list_key
from specrt.export.training.store_format import check_store

SHARD_ROWS = 16_384


def store_key(loaded: LoadedModel, max_new_tokens: int, taps, temperature: float, precision: str) -> dict:
    """What every answer in the store depends on (a store built with other settings is refused). The
    prompts are not in it: the store keeps a digest per prompt id (`prompt_digests`), so it can grow."""
    src = Path(loaded.source)
    stat = f"{src.resolve()}:{src.stat().st_size}" if src.exists() else str(loaded.source)
    return {"source": stat, "max_new_tokens": max_new_tokens, "taps": list(taps), "temperature": temperature,
            "precision": precision}


def _prompt_text(p: dict) -> str:
    return f"{p['split']}\t{p['prompt']}"


def prompt_digests(prompts: list[dict]) -> dict[str, str]:
    """Prompt id -> a digest of what its answers depend on (its text) and how they are used (its split)."""
    return {p["id"]: hashlib.sha256(_prompt_text(p).encode()).hexdigest()[:16] for p in prompts}


def upgrade_whole_list_key(root: Path, prompts: list[dict]) -> None:
    """A store written before stores could grow is keyed by one digest of its whole prompt list. If that
    list is `prompts`, or the part of it the store has answered, record per-id digests instead (it
    can grow from then on); otherwise refuse, saying how to upgrade it."""
    meta = check_store(root)
    old = None if meta is None else meta["key"].get("prompts")
    if not isinstance(old, str):
        return
    answered = answered_ids(meta)
    for rows in (prompts, [p for p in prompts if p["id"] in answered]):
        if hashlib.sha256("\n".join(map(_prompt_text, rows)).encode()).hexdigest()[:16] == old:
            forget_whole_list_key(root, meta, prompt_digests(rows))
            return
    raise SpecrtError(f"{root} was written by an earlier specrt for one whole prompt list, and these prompts are "
                      "neither that list nor contain it: run specrt distill once with the --prompts it was built "
                      "from (that lets it grow), then with the new ones; or choose another --store")


def default_store(cache_dir: Path, key: dict) -> Path:
    digest = hashlib.sha256(repr(sorted(key.items())).encode()).hexdigest()[:16]
    return cache_dir / f"store-{digest}"


def jobs_for(loaded: LoadedModel, prompts: list[dict], temperature: float, done: set[str]) -> Iterator[Job]:
    encoded = {p["id"]: encode(loaded, p["prompt"]) for p in prompts}
    for p in prompts:
        if p["split"] == "heldout" and f"0:{p['id']}" not in done:
            yield Job(f"0:{p['id']}", encoded[p["id"]], 0.0, True)
    train = [p for p in prompts if p["split"] != "heldout"]
    for r in itertools.count():
        for p in train:
            job = f"{r}:{p['id']}"
            if job not in done:
                yield Job(job, encoded[p["id"]], 0.0 if r == 0 else temperature, False)


def build_store(loaded: LoadedModel, prompts: list[dict], root: Path, tokens: int, max_new_tokens: int,
                taps: tuple[int, ...], temperature: float = 0.8, precision: str = "int8", slots: int = 64,
                max_minutes: float | None = None, progress: bool = True, engine: str = "auto",
                bundle: Path | None = None, threads: int = 2) -> dict:
    """Generate until the store at `root` holds `tokens` training answer tokens (or `max_minutes` have
    passed: no job starts after that, the ones in flight finish); returns a summary, which names the
    machine-chosen branches that ran (`engine`: torch's int8 engine, auto or forced: precision.py).
    `precision` "native": `bundle`'s int4 target answers on the native kernels (`threads` of them), and
    its states are the features (the store's key names the graph, as a `featurize_store` store's does)."""
    engine, engine_record = quant_engine(engine)  # a bad engine fails before the store is touched
    branches = {"aten_dispatch": aten_dispatch(), **({"quant_engine": engine_record} if precision == "int8" else {})}
    key = store_key(loaded, max_new_tokens, taps, temperature, precision)
    passes = None
    if precision == "native":
        if bundle is None:
            raise SpecrtError("native distillation runs a bundle's target: name the bundle (--target BUNDLE)")
        from specrt.export.training.native_answers import NativePasses

        passes = NativePasses(bundle, slots, MAX_PROMPT + max_new_tokens + 1, taps, threads)
        key["features"] = {"graph": "target", "sha256": passes.sha256}
        branches = {"native_kernel": passes.decoder.kernel_record}
    upgrade_whole_list_key(Path(root), prompts)
    writer = ShardWriter(root, taps, key, prompt_digests(prompts))
    have = writer.answer_tokens
    heldout_ids = {p["id"] for p in prompts if p["split"] == "heldout"}
    missing_heldout = any(f"0:{i}" not in writer.done_jobs for i in heldout_ids)
    counted = {"train": sum(s["answer_tokens"] - s.get("heldout_tokens", 0) for s in writer.meta["shards"])}
    summary = {"store": str(root), "had_answer_tokens": have, "target_tokens": tokens, "branches": branches}
    if counted["train"] >= tokens and not missing_heldout:
        return {**summary, "made": 0, "seconds": 0.0, "answer_tokens": have}

    def on_done(job: Job, fields: dict, prompt_len: int) -> None:
        writer.add(job.id, fields, prompt_len, job.heldout)
        if not job.heldout:
            counted["train"] += len(fields["tokens"]) - prompt_len
        if writer.pending_rows() >= SHARD_ROWS:
            writer.flush()

    if passes is None:
        with engine_in_use(engine):  # int8 linears are packed for the engine that runs them
            passes = quantized(loaded.module, precision)
    bar = tqdm(total=tokens, initial=min(counted["train"], tokens), desc="distill answers", unit="tok",
               disable=not progress, smoothing=0.05, mininterval=5)
    t0 = time.perf_counter()

    def stop() -> bool:
        return counted["train"] >= tokens or (max_minutes is not None and time.perf_counter() - t0 > 60 * max_minutes)

    try:
        with engine_in_use(engine):
            made = answer_jobs(passes, jobs_for(loaded, prompts, temperature, writer.done_jobs), max_new_tokens,
                               taps, on_done, slots=slots, stop=stop, progress=bar)
    finally:
        writer.flush()  # what finished is kept, even when interrupted
        bar.close()
    seconds = time.perf_counter() - t0
    return {**summary, "made": made, "seconds": round(seconds, 1), "tokens_per_second": round(made / max(seconds, 1e-9), 1),
            "answer_tokens": writer.answer_tokens, "train_answer_tokens": counted["train"]}


def load_store(root: Path) -> MappedData:
    return MappedData(root)
