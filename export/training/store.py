"""A resumable, memory-mapped store of distillation data: the target's answers and its state at every
position, written in shards as generation goes, read back without loading it into memory.

    STORE/meta.json            settings, taps, the shards in order, the job ids each one holds, and
                               each prompt id's digest (its text and split)
    STORE/shard-00007/*.npy    tokens int32 [N] · hidden fp16 [N,H] · aux fp16 [N,A] · top_ids int32 [N,K]
                               top_p fp16 [N,K] · offsets int64 [S+1] · prompt_lens int64 [S] · heldout bool [S]

A shard is written under a temporary name and renamed, then meta.json is replaced: an interrupted run
loses at most the shard it was filling (a partial folder, or a renamed one meta.json does not list yet:
the next run removes both), and the next run skips every job a listed shard holds. Before a store is
extended or read, every listed shard is checked against meta.json (store_format.py): a damaged one is
refused, named, never extended or trained on.
A store grows with its prompt corpus: new prompt ids join it, while an id it has answered must keep its
text and split (a changed one is refused by id: its stored answers would be another prompt's).
`MappedData` is what training reads: the same interface as the in-memory `DistillData`, with each
sequence's rows fetched from the shard files (np.load mmap) when a batch needs them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from specrt.errors import SpecrtError, changes
from specrt.export.training.store_format import FIELDS, SHARD_NAME, VERSION, check_store


def write_json(path: Path, obj) -> None:
    """Replace the file at `path` whole (a stop mid-write leaves the old one)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def answered_ids(meta: dict) -> set[str]:
    """The prompt ids a store's shards hold answers to (job ids are "ROUND:PROMPT_ID")."""
    return {job.split(":", 1)[1] for shard in meta["shards"] for job in shard["jobs"]}


def forget_whole_list_key(root: Path, meta: dict, prompts: dict[str, str]) -> None:
    """A store written before stores could grow is keyed by one digest of its whole prompt list: record
    per-id digests of that list (`prompts`) instead, and the old digest for the stores derived from it."""
    meta["key"] = dict(meta["key"])
    meta["whole_list_digest"] = meta["key"].pop("prompts")
    meta["prompts"] = prompts
    write_json(Path(root) / "meta.json", meta)


class ShardWriter:
    """Appends finished sequences to a store folder, one shard per `flush`."""

    def __init__(self, root: Path, taps: tuple[int, ...], key: dict, prompts: dict[str, str] | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        meta = check_store(self.root)  # a damaged store is refused before anything is added to it
        if meta is not None and meta["key"] != key:
            raise SpecrtError(f"{self.root} holds distillation data for other settings ({changes(meta['key'], key)}); "
                              "remove it or choose another folder")
        if meta is None:  # written now: a shard renamed just before a stop is then unlisted, removed next run
            meta = {"version": VERSION, "key": key, "taps": list(taps), "shards": []}
            write_json(self.root / "meta.json", meta)
        self.meta = meta
        listed = {s["name"] for s in self.meta["shards"]}
        for stale in self.root.glob(".shard-*"):  # a shard an interrupted run was writing
            shutil.rmtree(stale, ignore_errors=True)
        for unlisted in self.root.glob("shard-*"):  # renamed, but the run stopped before meta.json listed it
            if unlisted.is_dir() and unlisted.name not in listed:
                shutil.rmtree(unlisted, ignore_errors=True)
        self.pending: list[dict] = []
        if prompts is not None:
            self._take_prompts(prompts)

    def _take_prompts(self, prompts: dict[str, str]) -> None:
        """Record each prompt id's digest; refuse an id the store has answered whose digest changed."""
        held = self.meta.get("prompts", {})
        answered = answered_ids(self.meta)
        changed = sorted(i for i in answered if i in prompts and i in held and prompts[i] != held[i])
        if changed:
            more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            raise SpecrtError(f"{self.root} has answered prompt id(s) {', '.join(changed[:3])}{more} with another "
                              "text or split: give a changed prompt a new id, or choose another --store")
        merged = {**held, **prompts}
        if merged != held:
            self.meta["prompts"] = merged
            write_json(self.root / "meta.json", self.meta)

    @property
    def done_jobs(self) -> set[str]:
        return {j for s in self.meta["shards"] for j in s["jobs"]}

    @property
    def answer_tokens(self) -> int:
        return sum(s.get("answer_tokens", 0) for s in self.meta["shards"])

    def add(self, job: str, fields: dict[str, np.ndarray], prompt_len: int, heldout: bool) -> None:
        self.pending.append({"job": job, "fields": fields, "prompt_len": prompt_len, "heldout": heldout})

    def pending_rows(self) -> int:
        return sum(len(p["fields"]["tokens"]) for p in self.pending)

    def flush(self) -> None:
        if not self.pending:
            return
        used = [int(SHARD_NAME.fullmatch(s["name"]).group(1)) for s in self.meta["shards"]]
        name = f"shard-{max(used, default=-1) + 1:05d}"  # after the last listed (one may have been removed)
        tmp = self.root / f".{name}.partial-{os.getpid()}"
        tmp.mkdir()
        for f, dtype in FIELDS.items():
            np.save(tmp / f"{f}.npy", np.concatenate([p["fields"][f] for p in self.pending]).astype(dtype, copy=False))
        lens = [len(p["fields"]["tokens"]) for p in self.pending]
        np.save(tmp / "offsets.npy", np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
        np.save(tmp / "prompt_lens.npy", np.array([p["prompt_len"] for p in self.pending], np.int64))
        np.save(tmp / "heldout.npy", np.array([p["heldout"] for p in self.pending], bool))
        tmp.rename(self.root / name)
        answers = [n - p["prompt_len"] for n, p in zip(lens, self.pending, strict=True)]
        held = sum(a for a, p in zip(answers, self.pending, strict=True) if p["heldout"])
        self.meta["shards"].append({"name": name, "rows": int(sum(lens)), "answer_tokens": int(sum(answers)),
                                    "heldout_tokens": int(held),
                                    "jobs": [p["job"] for p in self.pending]})
        write_json(self.root / "meta.json", self.meta)
        self.pending = []


class MappedData:
    """A store's shards as one dataset (the interface training uses; rows stay on disk until fetched)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        meta = check_store(self.root)  # every shard whole, before any file is mapped
        if meta is None:
            raise SpecrtError(f"{self.root} is not a distillation store (no meta.json): build it with specrt distill")
        self.taps = tuple(meta["taps"])
        self.shards = []
        starts, prompt_lens, heldout, where = [0], [], [], []
        for s, shard in enumerate(meta["shards"]):
            folder = self.root / shard["name"]
            arrays = {f: np.load(folder / f"{f}.npy", mmap_mode="r") for f in FIELDS}
            offsets = np.load(folder / "offsets.npy")
            self.shards.append(arrays)
            for i in range(len(offsets) - 1):
                where.append((s, int(offsets[i]), int(offsets[i + 1])))
                starts.append(starts[-1] + int(offsets[i + 1] - offsets[i]))
            prompt_lens.append(np.load(folder / "prompt_lens.npy"))
            heldout.append(np.load(folder / "heldout.npy"))
        if not where:
            raise SpecrtError(f"{self.root} holds no sequences yet: build it with specrt distill")
        self._where = where
        self.offsets = torch.tensor(starts)
        self.prompt_lens = torch.from_numpy(np.concatenate(prompt_lens))
        self.heldout = torch.from_numpy(np.concatenate(heldout))
        self.answer_tokens = sum(s.get("answer_tokens", 0) for s in meta["shards"])

    def __len__(self) -> int:
        return len(self._where)

    def seq(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    def fetch(self, name: str, i: int) -> torch.Tensor:
        """Field `name` of sequence i (fp16 fields stay fp16; ints become int64)."""
        s, a, b = self._where[i]
        x = np.asarray(self.shards[s][name][a:b])
        return torch.from_numpy(x.astype(np.int64) if x.dtype == np.int32 else x.copy())

    @property
    def has_aux(self) -> bool:
        return self.shards[0]["aux"].shape[1] > 0

    def top_counts(self, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(how often each id is the target's top-1, how often it is in the top-k lists), over every shard."""
        top1, anywhere = np.zeros(vocab_size), np.zeros(vocab_size)
        for arrays in self.shards:
            ids = np.asarray(arrays["top_ids"])
            top1 += np.bincount(ids[:, 0], minlength=vocab_size)[:vocab_size]
            anywhere += np.bincount(ids.ravel(), minlength=vocab_size)[:vocab_size]
        return torch.from_numpy(top1).float(), torch.from_numpy(anywhere).float()
