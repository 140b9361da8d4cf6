"""A distillation store's answers alone, small enough to keep in git: every sequence's token ids, prompt
length, split and job id, with the store's key, taps and prompt digests. The features are what makes a
store large (~4.6 KB a row of hidden and tapped states); the answers are ~1 byte an answer token, and
`replay.replay_answers` recomputes the rest from them on the native kernels, bit for bit.

    STORE ──save_answers──► FILE.npz (LZMA; token ids as uint16 where the vocabulary allows: ~0.7 bytes
                            a row on SmolLM2's answers, ~1 byte an answer token with the metadata)
    FILE.npz ──load_answers──► Answers (checked whole before anything reads it)

The file is a plain NumPy archive read with `allow_pickle=False`: the job ids and the metadata are
UTF-8 JSON in uint8 arrays, never pickled objects.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError
from specrt.export.training.store_format import check_store

FORMAT = "specrt-answers"
VERSION = 1
ARRAYS = ("tokens", "offsets", "prompt_lens", "heldout", "jobs", "meta")


@dataclass(frozen=True)
class Answers:
    """What a store's answers are: sequence i is job `jobs[i]`, rows `tokens[offsets[i]:offsets[i+1]]`
    (its prompt, then the answer tokens that were fed back), the first `prompt_lens[i]` of them the prompt."""

    tokens: np.ndarray  # int32 [rows]
    offsets: np.ndarray  # int64 [sequences + 1]
    prompt_lens: np.ndarray  # int64 [sequences]
    heldout: np.ndarray  # bool [sequences]
    jobs: list[str]
    key: dict
    taps: tuple[int, ...]
    prompts: dict[str, str]

    def __len__(self) -> int:
        return len(self.jobs)

    def sequence(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    @property
    def answer_tokens(self) -> int:
        return int(self.offsets[-1] - self.prompt_lens.sum())


def _json_bytes(obj) -> np.ndarray:
    return np.frombuffer(json.dumps(obj, separators=(",", ":")).encode(), np.uint8)


def save_answers(store: Path, path: Path) -> dict:
    """Write every sequence of the distillation store `store` to `path` (replaced whole: a stop mid-write
    leaves the old file); returns a summary (sequences, rows, answer tokens, bytes)."""
    from specrt.export.training.store import MappedData, answered_ids

    store, path = Path(store), Path(path)
    meta = check_store(store)
    if meta is None:
        raise SpecrtError(f"{store} is not a distillation store (no meta.json): build it with specrt distill")
    data = MappedData(store)
    tokens = np.concatenate([np.asarray(s["tokens"]) for s in data.shards]).astype(np.int64)
    small = tokens.size == 0 or (tokens.min() >= 0 and tokens.max() <= np.iinfo(np.uint16).max)
    jobs = [j for s in meta["shards"] for j in s["jobs"]]
    answered = answered_ids(meta)  # the digests of prompts it holds answers to, not of its whole corpus
    prompts = {i: d for i, d in meta.get("prompts", {}).items() if i in answered}
    head = {"format": FORMAT, "version": VERSION, "key": meta["key"], "taps": meta["taps"], "prompts": prompts}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.npz")
    try:
        arrays = {"tokens": tokens.astype(np.uint16 if small else np.int32),
                  "offsets": data.offsets.numpy().astype(np.int64), "prompt_lens": data.prompt_lens.numpy(),
                  "heldout": data.heldout.numpy(), "jobs": _json_bytes(jobs), "meta": _json_bytes(head)}
        # an .npz np.load reads, its members LZMA-compressed (0.78x zlib's size on these arrays)
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_LZMA) as z:
            for name, a in arrays.items():
                with z.open(f"{name}.npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, a, allow_pickle=False)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return {"answers": str(path), "store": str(store), "sequences": len(jobs), "rows": int(tokens.size),
            "answer_tokens": int(tokens.size - int(data.prompt_lens.sum())), "bytes": path.stat().st_size}


def _refuse(path: Path, problem: str) -> SpecrtError:
    return SpecrtError(f"answers file {path} {problem}: write it again with specrt answers save STORE -o {path}")


def load_answers(path: Path) -> Answers:
    """The answers in `path`, checked whole: a file that is not one, or whose arrays disagree, is refused."""
    path = Path(path)
    if not path.is_file():
        raise SpecrtError(f"answers file {path} does not exist: write one with specrt answers save STORE -o {path}")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [a for a in ARRAYS if a not in z.files]
            if missing:
                raise _refuse(path, f"has no array {', '.join(missing)}")
            arrays = {a: z[a] for a in ARRAYS}
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise _refuse(path, f"is not a readable answers archive ({e})") from None
    try:
        head = json.loads(arrays["meta"].astype(np.uint8).tobytes())
        jobs = json.loads(arrays["jobs"].astype(np.uint8).tobytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise _refuse(path, f"has metadata that does not parse ({e})") from None
    if not isinstance(head, dict) or head.get("format") != FORMAT or head.get("version") != VERSION:
        raise _refuse(path, f"is not a {FORMAT} file of version {VERSION}")
    if not isinstance(head.get("key"), dict) or not all(isinstance(t, int) for t in head.get("taps", [None])):
        raise _refuse(path, "has no store key or taps")
    if not isinstance(jobs, list) or not all(isinstance(j, str) for j in jobs):
        raise _refuse(path, "has job ids that are not a list of strings")
    tokens, offsets = arrays["tokens"], arrays["offsets"]
    prompt_lens, heldout = arrays["prompt_lens"], arrays["heldout"]
    n = len(jobs)
    if tokens.ndim != 1 or tokens.dtype not in (np.uint16, np.int32):
        raise _refuse(path, f"has tokens of shape {tokens.shape} and dtype {tokens.dtype}, not uint16/int32 rows")
    if offsets.shape != (n + 1,) or prompt_lens.shape != (n,) or heldout.shape != (n,) or heldout.dtype != np.bool_:
        raise _refuse(path, f"has {n} job ids but offsets {offsets.shape}, prompt lengths {prompt_lens.shape} and "
                            f"splits {heldout.shape}")
    lengths = np.diff(offsets)
    if n and (offsets[0] != 0 or offsets[-1] != tokens.size or (lengths < 1).any()):
        raise _refuse(path, f"has sequence offsets that do not cover its {tokens.size} token rows in order")
    if n and ((prompt_lens < 1) | (prompt_lens > lengths)).any():
        raise _refuse(path, "has a prompt length outside its sequence")
    if len(set(jobs)) != n:
        raise _refuse(path, "lists a job id twice")
    return Answers(tokens.astype(np.int32), offsets.astype(np.int64), prompt_lens.astype(np.int64), heldout, jobs,
                   head["key"], tuple(head["taps"]), dict(head.get("prompts", {})))
