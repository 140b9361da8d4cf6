"""The shipped prompt corpus (specrt/data/train_prompts.jsonl): 480 prompts in 8 categories, written
for specrt (no public benchmark's questions); every 6th prompt of a category is held out."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from specrt.errors import SpecrtError


def load_prompts(split: str | None = None, path: Path | None = None) -> list[dict]:
    """Prompts as dicts {id, category, split, prompt}; `split` 'train' / 'heldout' filters."""
    text = Path(path).read_text() if path else (resources.files("specrt") / "data" / "train_prompts.jsonl").read_text()
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            row["prompt"], row.setdefault("split", "train"), row.setdefault("id", f"p{n}")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SpecrtError(f"{path or 'train_prompts.jsonl'} line {n} is not a prompt object "
                              f'({type(e).__name__}): write {{"prompt": "..."}} per line') from None
        rows.append(row)
    return [r for r in rows if split is None or r["split"] == split]


def load_corpora(paths) -> list[dict]:
    """The prompts of every file in `paths` in order (none: the shipped corpus); an id two files share is
    refused, since a store keys its jobs by prompt id."""
    if not paths:
        return load_prompts()
    rows, seen = [], {}
    for path in paths:
        for row in load_prompts(path=path):
            if row["id"] in seen:
                raise SpecrtError(f"prompt id {row['id']!r} is in both {seen[row['id']]} and {path}: give one of "
                                  "them other ids")
            seen[row["id"]] = path
            rows.append(row)
    return rows
