"""The on-disk layout of a distillation store, and the check that a store is whole before anything
extends it (`specrt distill`) or trains on it (`MappedData`, `specrt train --store`).

The check reads meta.json, each .npy header, each file's size and the three per-sequence arrays (a few
bytes per sequence), never the rows themselves: every shard meta.json lists must have all its files,
each with the dtype and the shape its row and sequence counts imply (one hidden width, tap width and
top-k across shards) and exactly the size its header announces. A damaged store is refused with one
line naming the shard, the file, what is wrong and what to do.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError

VERSION = 1
# per-row fields: name -> dtype; their first axis is the shard's rows
FIELDS = {"tokens": np.int32, "hidden": np.float16, "aux": np.float16, "top_ids": np.int32, "top_p": np.float16}
# per-sequence fields (offsets has one more entry: the row each sequence starts at, then the end)
SEQ_FIELDS = {"offsets": np.int64, "prompt_lens": np.int64, "heldout": np.bool_}
# the width each 2-D field shares across shards: field -> the name of that width
WIDTHS = {"hidden": "hidden size", "aux": "tapped-layer width", "top_ids": "top-k", "top_p": "top-k"}
SHARD_NAME = re.compile(r"shard-(\d{5})")
_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def _fix(root: Path, name: str) -> str:
    return (f"delete the folder {root / name} and its entry in {root / 'meta.json'} (distill answers its prompts "
            "again), or rerun specrt distill with --store NEW_FOLDER")


def _refuse_meta(root: Path, problem: str) -> SpecrtError:
    return SpecrtError(f"distillation store {root} is damaged: {root / 'meta.json'} {problem}: rerun specrt distill "
                       f"with --store NEW_FOLDER (or delete {root} and rerun the same command)")


def _meta_problem(meta) -> str | None:
    """What is wrong with a parsed meta.json, or None."""
    if not isinstance(meta, dict):
        return f"holds a {type(meta).__name__}, not an object"
    if meta.get("version") != VERSION:
        return f"has version {meta.get('version')!r}; this specrt reads version {VERSION}"
    if not isinstance(meta.get("key"), dict):
        return 'has no "key" object (the settings the data was made with)'
    prompts = meta.get("prompts", {})
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        return 'has "prompts" that is not an object of prompt id -> digest'
    taps, shards = meta.get("taps"), meta.get("shards")
    if not isinstance(taps, list) or not all(isinstance(t, int) for t in taps):
        return f'has "taps" {taps!r}, not a list of layer indices'
    if not isinstance(shards, list):
        return f'has "shards" {shards!r}, not a list'
    names = set()
    for i, s in enumerate(shards):
        if not isinstance(s, dict) or not isinstance(s.get("name"), str) or not SHARD_NAME.fullmatch(s["name"]):
            return f"shard entry {i} has no name of the form shard-NNNNN"
        if s["name"] in names:
            return f"lists {s['name']} twice"
        names.add(s["name"])
        if not isinstance(s.get("rows"), int) or s["rows"] < 0:
            return f'entry {s["name"]} has "rows" {s.get("rows")!r}, not a row count'
        if not isinstance(s.get("jobs"), list) or not all(isinstance(j, str) for j in s["jobs"]):
            return f'entry {s["name"]} has no "jobs" list'
    return None


def read_meta(root: Path) -> dict | None:
    """`root`/meta.json as a dict, or None when there is none (a new store); one that does not parse or
    lacks the fields a store's metadata has is refused."""
    root = Path(root)
    path = root / "meta.json"
    if not path.is_file():
        if any(p.is_dir() and SHARD_NAME.fullmatch(p.name) for p in root.glob("shard-*")):
            raise _refuse_meta(root, "is missing, yet shard folders are there")
        return None
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _refuse_meta(root, f"does not parse ({e})") from None
    problem = _meta_problem(meta)
    if problem:
        raise _refuse_meta(root, problem)
    return meta


def npy_header(path: Path) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, expected file size) from a .npy file's header; ValueError when it does not parse."""
    with path.open("rb") as f:
        version = np.lib.format.read_magic(f)
        if version not in _HEADER_READERS:
            raise ValueError(f"unsupported .npy version {version}")
        shape, _, dtype = _HEADER_READERS[version](f)
        return shape, dtype, f.tell() + math.prod(shape) * dtype.itemsize


def _check_file(path: Path, dtype, shape: tuple[int | None, ...]) -> tuple[int, ...]:
    """The file's shape, after checking its header, dtype, shape (None: any length) and size against them;
    raises `_Problem` saying what differs."""
    if not path.is_file():
        raise _Problem("is missing")
    try:
        got_shape, got_dtype, size = npy_header(path)
    except (OSError, ValueError, EOFError) as e:
        raise _Problem(f"has no readable .npy header ({e})") from None
    if got_dtype != np.dtype(dtype):
        raise _Problem(f"holds {got_dtype}, the store writes {np.dtype(dtype)}")
    if len(got_shape) != len(shape) or any(w is not None and g != w for g, w in zip(got_shape, shape, strict=True)):
        want = ["*" if d is None else d for d in shape]
        raise _Problem(f"has shape {list(got_shape)}, meta.json implies {want}")
    actual = path.stat().st_size
    if actual != size:
        raise _Problem(f"is {actual} bytes, its header says {size} ({'truncated' if actual < size else 'extra bytes'})")
    return got_shape


class _Problem(Exception):
    """What is wrong with one file of a shard."""


def _sequence_problem(folder: Path, rows: int) -> tuple[str, str] | None:
    """offsets run from 0 to the row count without going back, and each prompt fits in its sequence."""
    offsets = np.load(folder / "offsets.npy")
    if offsets[0] != 0 or offsets[-1] != rows or (np.diff(offsets) < 0).any():
        return "offsets.npy", f"does not run from 0 to the shard's {rows} rows in order"
    prompt_lens = np.load(folder / "prompt_lens.npy")
    if ((prompt_lens < 1) | (prompt_lens > np.diff(offsets))).any():
        return "prompt_lens.npy", "has a prompt longer than its sequence"
    return None


def _shard_problem(folder: Path, entry: dict, n_taps: int, widths: dict) -> tuple[str, str] | None:
    """(file, what is wrong) for the first problem of one shard, or None; `widths` carries the first
    shard's widths to the next."""
    if not folder.is_dir():
        return "", "is missing"
    rows, seqs = entry["rows"], len(entry["jobs"])
    want = {**{f: (dtype, (rows,) if f == "tokens" else (rows, None)) for f, dtype in FIELDS.items()},
            **{f: (dtype, (seqs + 1,) if f == "offsets" else (seqs,)) for f, dtype in SEQ_FIELDS.items()}}
    shapes = {}
    for field, (dtype, shape) in want.items():
        try:
            shapes[field] = _check_file(folder / f"{field}.npy", dtype, shape)
        except _Problem as p:
            return f"{field}.npy", str(p)
    for field, what in WIDTHS.items():
        first_shard, first = widths.setdefault(what, (folder.name, shapes[field][1]))
        if shapes[field][1] != first:
            return f"{field}.npy", f"has {what} {shapes[field][1]}, {first_shard} has {first}"
    hidden, aux = shapes["hidden"][1], shapes["aux"][1]
    if aux != n_taps * hidden:
        return "aux.npy", f"is {aux} wide, meta.json's {n_taps} taps of hidden size {hidden} make {n_taps * hidden}"
    return _sequence_problem(folder, rows)


def check_shards(root: Path, meta: dict) -> None:
    """Refuse the store at `root` (one line: shard, file, problem, fix) unless every shard `meta` lists is
    whole; reads headers, sizes and the per-sequence arrays only, never the rows."""
    root = Path(root)
    widths: dict[str, tuple[str, int]] = {}  # width name -> (the first shard, its value)
    for entry in meta["shards"]:
        found = _shard_problem(root / entry["name"], entry, len(meta["taps"]), widths)
        if found:
            file, problem = found
            where = f"{entry['name']}/{file}" if file else entry["name"]
            raise SpecrtError(f"distillation store {root} is damaged: {where} {problem}: {_fix(root, entry['name'])}")


def check_store(root: Path) -> dict | None:
    """meta.json of the store at `root` (None: no store there yet) after checking every shard it lists."""
    meta = read_meta(root)
    if meta is not None:
        check_shards(root, meta)
    return meta
