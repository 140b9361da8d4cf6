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

from pathlib import Path

import numpy as np
import torch

from specrt.errors import SpecrtError
from specrt.export.training.answer_file import Answers
from specrt.export.training.graph_features import chunked_features, write_sequences
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
    sequences = ((answers.jobs[i], answers.sequence(i), int(answers.prompt_lens[i]), bool(answers.heldout[i]),
                  _greedy(answers.jobs[i])) for i in todo)
    w = write_sequences(writer, sequences, lambda t: chunked_features(lambda ids, a: passes.extend(0, ids, a), t, chunk),
                        rows, "replay answers", progress, max_minutes)
    return {"store": str(root), "bundle": str(bundle), "made": w.made, "sequences": len(writer.done_jobs),
            "left": len(todo) - w.made, "seconds": round(w.seconds, 1),
            "rows_per_second": round(w.rows / max(w.seconds, 1e-9), 1),
            "answer_tokens": writer.answer_tokens, "same_graph": wrote == digest,
            "greedy_argmax_is_stored_token": w.agreement(),
            "branches": {"native_kernel": passes.decoder.kernel_record}}
