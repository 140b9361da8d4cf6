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
