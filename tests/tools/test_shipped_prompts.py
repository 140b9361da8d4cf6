"""The prompt files shipped for distillation (drafters/*/prompts/*.jsonl) are training data a learned drafter is
fitted on, so they are held to what `specrt prompts` promises when it writes them: rows `specrt distill
--prompts` reads, ids unique across every file (one store joins them), and no prompt the same as, or a near
duplicate of, a prompt any held-out check is run on (the shipped held-out split and the benchmark set)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specrt.tools.magpie import heldout_index

FILES = sorted(Path(__file__).resolve().parents[2].glob("drafters/*/prompts/*.jsonl"))


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_there_are_shipped_prompt_files():
    assert len(FILES) >= 5, FILES


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_a_shipped_prompt_file_is_distillable_and_never_a_held_out_prompt(path):
    held_out = heldout_index()
    found = rows(path)
    assert found, path
    for row in found:
        assert isinstance(row.get("id"), str) and row["id"], (path.name, row)
        assert isinstance(row.get("prompt"), str) and row["prompt"].strip(), (path.name, row["id"])
        assert row.get("split") in ("train", "heldout"), (path.name, row["id"])
        assert not held_out.match(row["prompt"]), f"{path.name} {row['id']} repeats a held-out prompt"


def test_ids_are_unique_across_every_shipped_file():
    seen: dict[str, str] = {}
    for path in FILES:
        for row in rows(path):
            assert row["id"] not in seen, f"{row['id']} is in {seen.get(row['id'])} and {path.name}"
            seen[row["id"]] = path.name
