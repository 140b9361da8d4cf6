"""Requests about a given text (tools/text_prompts.py): prose paragraphs become one request each, code, lists,
lead-ins and an assistant's talk about itself are not passages, a store's held-out answers are never used, the
same seed writes the same file, and repeats or held-out prompts are dropped."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from specrt.cli import cli
from specrt.errors import SpecrtError
from specrt.export.training.distill import prompt_digests, store_key
from specrt.export.training.store import ShardWriter
from specrt.tools import text_prompts as tp

WORDS = ("river stone garden market window bridge summer lantern orchard harbour village meadow candle forest "
         "letter engine valley morning island shadow").split()


def prose(seed: int, words: int = 40) -> str:
    """A sentence-like paragraph of `words` words, distinct per seed."""
    rng = np.random.default_rng(seed)
    body = " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), words - 2))
    return f"The {body} today."


def test_only_paragraphs_of_running_text_are_passages():
    good = prose(1)
    assert tp.is_prose(good)
    not_passages = {
        "too short": "The river ran past the mill.",
        "too long": prose(2, tp.MAX_WORDS + 5),
        "code": "```python\n" + prose(3) + "\n```",
        "list": "- " + prose(4),
        "numbered": "1. " + prose(5),
        "heading": "# " + prose(6),
        "link": prose(7) + " See https://example.org for more.",
        "inline code": prose(8) + " Call `run()` first.",
        "lead-in": prose(9) + " Here are the steps:",
        "assistant": "I'd be happy to help. " + prose(10),
        "as an AI": prose(11) + " As an AI language model I cannot say more.",
    }
    for why, text in not_passages.items():
        assert not tp.is_prose(text), why
    text = "\n\n".join([good, not_passages["list"], prose(12), "Short one."])
    assert list(tp.paragraphs(text)) == [good, prose(12)]
    wrapped = prose(13).replace(" ", "\n", 1)  # a paragraph wrapped over lines is one passage
    assert list(tp.paragraphs(wrapped)) == [prose(13)]


def test_each_source_gives_one_request_the_same_seed_the_same_file(tmp_path):
    files = []
    for n in range(30):
        f = tmp_path / f"doc{n}.txt"
        f.write_text(f"{prose(100 + n)}\n\n{prose(200 + n)}\n")
        files.append(f)
    rows, summary = tp.text_prompts(tp.passages(files), 100, seed=4)
    assert summary["passages"] == 30 and len(rows) == 30  # the first passage of each file, never its second
    assert {r["source"] for r in rows} == {f"doc{n}.txt:0" for n in range(30)}
    assert all(prose(200 + n) not in r["prompt"] for r in rows for n in range(30))
    assert [r["id"] for r in rows] == [f"text-{i}" for i in range(1, 31)]
    tasks = dict(tp.TASKS)
    for r in rows:
        assert r["category"] == "rewrite" and r["split"] in ("train", "heldout") and r["task"] in tasks
        passage = r["prompt"].split("\n\n", 1)[1]
        assert r["prompt"] == tasks[r["task"]].format(text=passage)
    assert len({r["task"] for r in rows}) > 3  # the kind comes from a hash of the passage, not one for all
    assert rows == tp.text_prompts(tp.passages(files), 100, seed=4)[0]
    assert [r["prompt"] for r in rows] != [r["prompt"] for r in tp.text_prompts(tp.passages(files), 100, seed=5)[0]]
    assert len(tp.text_prompts(tp.passages(files), 7, seed=4)[0]) == 7


def test_repeated_passages_and_heldout_prompts_are_dropped(tmp_path):
    a, b, c = (tmp_path / f"{n}.md" for n in "abc")
    a.write_text(prose(1))
    b.write_text(prose(1))  # the same passage again: a repeat whatever it is asked for
    c.write_text(prose(2))
    rows, summary = tp.text_prompts(tp.passages([a, b, c]), 10)
    assert len(rows) == 2 and summary["dropped"]["duplicate"] == 1
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"prompt": "Rewrite this in simpler English:\n\n" + prose(2), "split": "heldout"}) + "\n")
    rows, summary = tp.text_prompts(tp.passages([a, c]), 10, heldout_files=[held])
    assert [r["source"] for r in rows] == ["a.md:0"] and summary["dropped"]["held-out duplicate"] == 1


class Letters:
    """A tokenizer whose ids are word indices (what `store_answers` decodes with)."""

    def decode(self, ids):
        return " ".join(WORDS[i % len(WORDS)] for i in ids)


def test_a_store_gives_its_training_answers_never_its_heldout_ones(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"weights")
    prompts = [{"id": "h", "split": "heldout", "prompt": "held"}, {"id": "t", "split": "train", "prompt": "train"}]
    root = tmp_path / "store"
    writer = ShardWriter(root, (0,), store_key(SimpleNamespace(source=str(source), module=None), 40, (0,), 0.8,
                                              "int8"), prompt_digests(prompts))
    rng = np.random.default_rng(0)
    for job, heldout, first in (("0:h", True, 0), ("0:t", False, 7)):
        n = 3 + 30
        tokens = np.array([1, 2, 3, *[(first + i) % len(WORDS) for i in range(30)]], np.int32)
        writer.add(job, {"tokens": tokens, "hidden": rng.standard_normal((n, 4)).astype(np.float16),
                         "aux": rng.standard_normal((n, 4)).astype(np.float16),
                         "top_ids": np.zeros((n, 2), np.int32), "top_p": np.zeros((n, 2), np.float16)}, 3, heldout)
    writer.flush()
    answers = list(tp.store_answers(root, Letters()))
    assert answers == [Letters().decode([(7 + i) % len(WORDS) for i in range(30)])]  # the answer, not the prompt
    with pytest.raises(SpecrtError, match="name one"):
        list(tp.passages([root]))
    with pytest.raises(SpecrtError, match="not a distillation store"):
        list(tp.passages([tmp_path], Letters()))


def test_the_command_writes_jsonl_and_refuses_other_files(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("\n\n".join(prose(n) for n in range(3)))
    out = tmp_path / "o" / "text.jsonl"
    r = CliRunner().invoke(cli, ["text-prompts", "-o", str(out), "--from", str(doc)])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["written"] == 1 and len(out.read_text().splitlines()) == 1
    other = tmp_path / "data.csv"
    other.write_text("a,b\n")
    with pytest.raises(SpecrtError, match="store folder or a text file"):
        list(tp.passages([Path(other)]))
