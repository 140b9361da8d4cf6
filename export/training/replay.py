"""A distillation store rebuilt from its answers (answer_file.py) on the native kernels: every sequence is
prefilled in chunks of rows by the bundle's int4 target, and its hidden states, tapped states and top-k
are the rows `specrt distill --backend native` stored while answering. The native kernels compute a
row of a many-row pass as a one-row pass does, so a store replayed by the graph that wrote the answers
is the distilled store bit for bit (tests/export/test_answer_replay.py), at prefill speed rather than
one decode pass per token (~2.5x faster, and no sampling to redo).

    answers.npz ──► prefill of each sequence, CHUNK rows a pass ──► ShardWriter: the same jobs, splits,
    tokens and features, keyed as the answers' store was (its graph: the bundle replaying them)

Resumable as `specrt distill` is: a rerun skips the jobs the store holds. Answers written by another
graph are replayed too (a re-exported bundle); the summary says whether the graph is the one that wrote
them and how often its argmax is the stored token where the answer was greedy (1.0 on the same graph).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from specrt.errors import SpecrtError
from specrt.export.training.answer_file import Answers
from specrt.export.training.distill import SHARD_ROWS
from specrt.export.training.graph_features import chunked_features
from specrt.export.training.store import ShardWriter

CHUNK = 256  # rows a prefill pass takes: compute-bound well before this on every kernel measured


def _greedy(job: str) -> bool:
    return job.split(":", 1)[0] == "0"  # round 0 answers greedily (distill.jobs_for)


@torch.no_grad()
def replay_answers(answers: Answers, root: Path, bundle: Path, threads: int = 2, progress: bool = True,
                   max_minutes: float | None = None, chunk: int = CHUNK) -> dict:
    """Write (or extend) the store `root` with every sequence of `answers`, its states from `bundle`'s
    target on the native kernels; returns a summary (sequences made, rows/s, greedy agreement)."""
    from specrt.export.training.native_answers import NativePasses
    from specrt.schema.manifest import Manifest

    manifest = Manifest.load(bundle)
    cfg = manifest.graphs["target"].config
    if len(answers) and (int(answers.tokens.min()) < 0 or int(answers.tokens.max()) >= cfg.vocab_size):
        raise SpecrtError(f"the answers hold token ids outside 0..{cfg.vocab_size - 1}, {bundle}'s target vocabulary: "
                          "replay them with the bundle of the model that wrote them")
    if any(t >= cfg.num_layers for t in answers.taps):
        raise SpecrtError(f"the answers tap layers {list(answers.taps)}; {bundle}'s target has {cfg.num_layers}: "
                          "replay them with the bundle of the model that wrote them")
    digest = manifest.graphs["target"].sha256
    wrote = (answers.key.get("features") or {}).get("sha256")
    key = {**answers.key, "features": {"graph": "target", "sha256": digest}}
    writer = ShardWriter(root, answers.taps, key, answers.prompts)
    done = writer.done_jobs
    todo = [i for i, j in enumerate(answers.jobs) if j not in done]
    lengths = np.diff(answers.offsets)
    capacity = int(max((lengths[i] for i in todo), default=1))
    rows = int(sum(lengths[i] for i in todo))
    passes = NativePasses(Path(bundle), 1, capacity, answers.taps, threads)
    agree = [0, 0]
    t0 = time.perf_counter()
    bar = tqdm(total=rows, desc="replay answers", unit="row", disable=not progress, mininterval=5)
    made = done_rows = 0
    try:
        for i in todo:
            if max_minutes is not None and time.perf_counter() - t0 > 60 * max_minutes:
                break
            tokens = answers.sequence(i)
            fields = chunked_features(lambda ids, a: passes.extend(0, ids, a), tokens, chunk)
            start = int(answers.prompt_lens[i])
            if _greedy(answers.jobs[i]):  # row r's argmax is answer token r+1
                agree[0] += int((fields["top_ids"][start - 1 : -1, 0] == tokens[start:]).sum())
                agree[1] += len(tokens) - start
            writer.add(answers.jobs[i], fields, start, bool(answers.heldout[i]))
            made += 1
            done_rows += len(tokens)
            if writer.pending_rows() >= SHARD_ROWS:
                writer.flush()
            bar.update(len(tokens))
    finally:
        writer.flush()  # what finished is kept, even when interrupted
        bar.close()
    seconds = time.perf_counter() - t0
    return {"store": str(root), "bundle": str(bundle), "made": made, "sequences": len(writer.done_jobs),
            "left": len(todo) - made, "seconds": round(seconds, 1), "rows_per_second": round(done_rows / max(seconds, 1e-9), 1),
            "answer_tokens": writer.answer_tokens, "same_graph": wrote == digest,
            "greedy_argmax_is_stored_token": round(agree[0] / agree[1], 4) if agree[1] else None,
            "branches": {"native_kernel": passes.decoder.kernel_record}}
