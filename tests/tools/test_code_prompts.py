"""Code prompts cut from Python sources: functions of the right size become requests about them, the same
seed writes the same file, repeats and held-out prompts are dropped, and a completion hides the body."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specrt.cli import cli
from specrt.errors import SpecrtError
from specrt.tools import code_prompts as cp


def _fn(name: str, body_lines: int, doc: bool = True) -> str:
    doc_line = f'    """Return the {name} of x."""\n' if doc else ""
    body = "".join(f"    x = x + {i}  # step {name} {i}\n" for i in range(body_lines))
    return f"def {name}(x):\n{doc_line}{body}    return x\n\n\n"


@pytest.fixture
def sources(tmp_path):
    root = tmp_path / "src"
    (root / "pkg").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "pkg" / "a.py").write_text(_fn("alpha", 4) + _fn("beta", 5, doc=False) + _fn("tiny", 0) + _fn("huge", 60))
    (root / "pkg" / "b.py").write_text(_fn("gamma", 6) + _fn("delta", 3))
    (root / "pkg" / "copy.py").write_text(_fn("alpha", 4))  # the same function again: a duplicate
    (root / "tests" / "t.py").write_text(_fn("skipped", 4))  # test folders are not sources
    (root / "pkg" / "broken.py").write_text("def (:\n")  # does not parse: no prompts, no error
    return root


def test_functions_of_the_right_size_become_requests(sources):
    rows, summary = cp.code_prompts(100, [sources], seed=1)
    names = {r["source"].split(":")[0] for r in rows}
    assert "tests/t.py" not in names and summary["files"] == 4
    text = "\n".join(r["prompt"] for r in rows)
    assert "def tiny" not in text and "def huge" not in text and "def skipped" not in text  # too short, long
    assert sum("def alpha" in r["prompt"] for r in rows) == 1 and summary["dropped"]["duplicate"] == 1
    assert [r["id"] for r in rows] == [f"code-py-{i}" for i in range(1, len(rows) + 1)]
    for r in rows:
        assert r["category"] == "code" and r["split"] in ("train", "heldout") and r["task"] in dict(cp.TASKS)
        if r["task"] == "complete":  # signature and docstring, never the body it asks for
            assert '"""Return the' in r["prompt"] and "x = x + 0" not in r["prompt"]
        if r["task"] == "docstring":
            assert '"""' not in r["prompt"] and "x = x + 0" in r["prompt"]
    assert rows == cp.code_prompts(100, [sources], seed=1)[0]  # the same seed, the same file


def test_every_task_builds_its_request():
    import ast

    code = _fn("alpha", 4)
    fn = ast.parse(code).body[0]
    built = {name: build(fn, code.rstrip()) for name, build in cp.TASKS}
    assert all(built.values()), built
    assert "x = x + 3" not in built["complete"] and "Return the alpha" in built["complete"]
    assert "Return the alpha" not in built["docstring"] and "x = x + 3" in built["docstring"]
    bare = _fn("beta", 4, doc=False)
    assert cp.TASKS[1][1](ast.parse(bare).body[0], bare) is None  # no docstring: nothing to complete from


def test_repeats_and_heldout_prompts_are_dropped(sources, tmp_path):
    rows, _ = cp.code_prompts(100, [sources], seed=3)
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"prompt": r["prompt"], "split": "heldout"}) + "\n" for r in rows[:1]))
    again, summary = cp.code_prompts(100, [sources], seed=3, heldout_files=[held])
    assert rows[0]["prompt"] not in [r["prompt"] for r in again]
    assert summary["dropped"]["held-out duplicate"] >= 1


def test_the_command_writes_jsonl_and_refuses_a_missing_folder(sources, tmp_path):
    out = tmp_path / "o" / "code.jsonl"
    r = CliRunner().invoke(cli, ["code-prompts", "-o", str(out), "--count", "2", "--from", str(sources)])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and json.loads(r.output)["written"] == 2
    with pytest.raises(SpecrtError, match="not a folder of Python sources"):
        cp.source_files([tmp_path / "missing"])
