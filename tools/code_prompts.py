"""Code prompts cut from the Python sources on the machine (the standard library unless told otherwise).

A chat model is asked about code as often as anything, and a drafter trained only on prose drafts code
badly. Magpie prompts rarely hold code, so these are cut from real functions: each function of 4 to 40
lines, parsed with `ast`, becomes one request about it (explain it, complete it from its signature and
docstring, document it, test it, simplify it, find its edge cases), the kind by a hash of the function so
a rerun writes the same file. Prompts that repeat a kept one or any held-out prompt (exactly or nearly,
magpie.NearDuplicates) are dropped; a share goes to a held-out split of their own.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import sysconfig
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.tools.magpie import NearDuplicates, heldout_index, split_of

MIN_LINES, MAX_LINES, MAX_CHARS = 4, 40, 1600  # a function's size; the prompt's (a slot takes 512 tokens)
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3", "turtledemo"}


def _fenced(code: str) -> str:
    return f"```python\n{code.rstrip()}\n```"


def _head(fn: ast.FunctionDef, code: str) -> str | None:
    """The signature and docstring only (what a completion starts from); None without a docstring."""
    if ast.get_docstring(fn) is None or len(fn.body) < 2:
        return None
    lines = code.splitlines()
    end = fn.body[1].lineno - fn.lineno  # the line the first statement after the docstring starts on
    return "\n".join(lines[:end])


def _undocumented(fn: ast.FunctionDef, code: str) -> str | None:
    if ast.get_docstring(fn) is None or len(fn.body) < 2:
        return None
    lines = code.splitlines()
    doc = fn.body[0]
    return "\n".join(lines[: doc.lineno - fn.lineno] + lines[doc.end_lineno - fn.lineno + 1 :])


# request kinds: (name, build(fn, code) -> prompt or None)
TASKS = (
    ("explain", lambda fn, code: f"Explain what this Python function does, step by step:\n\n{_fenced(code)}"),
    ("complete", lambda fn, code: (h := _head(fn, code)) and f"Complete this Python function:\n\n{_fenced(h)}"),
    ("docstring", lambda fn, code: (u := _undocumented(fn, code))
     and f"Write a docstring for this Python function:\n\n{_fenced(u)}"),
    ("tests", lambda fn, code: f"Write a few unit tests with pytest for this function:\n\n{_fenced(code)}"),
    ("simplify", lambda fn, code: f"Can this Python function be written more simply? Show how.\n\n{_fenced(code)}"),
    ("edge", lambda fn, code: f"Which inputs could make this function fail or misbehave?\n\n{_fenced(code)}"),
)


def default_roots() -> list[Path]:
    return [Path(sysconfig.get_paths()["stdlib"])]


def source_files(roots: Iterable[Path]) -> list[Path]:
    """Every .py file under `roots`, sorted, outside test and vendored folders."""
    files = []
    for root in roots:
        root = Path(root)
        if not root.is_dir():
            raise SpecrtError(f"--from {root}: not a folder of Python sources")
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
            files += [Path(folder) / n for n in sorted(names) if n.endswith(".py") and not n.startswith("test_")]
    return files


def functions(path: Path) -> Iterator[tuple[ast.FunctionDef, str]]:
    """(function node, its source dedented) for each function of `path` of MIN..MAX lines."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return  # a file that does not parse here (another Python's syntax, a template) has no prompts
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.decorator_list:
            lines = node.end_lineno - node.lineno + 1
            if MIN_LINES <= lines <= MAX_LINES:
                code = ast.get_source_segment(text, node, padded=True)
                if code and "\t" not in code:
                    yield node, textwrap.dedent(code)


def code_prompts(count: int, roots: Iterable[Path] | None = None, seed: int = 0, heldout_files: Iterable[Path] = (),
                 threshold: float = 0.7, heldout_share: float = 0.02) -> tuple[list[dict], dict]:
    """Up to `count` prompt rows (ids code-py-N) and a summary of what was dropped and why."""
    roots = list(roots) if roots else default_roots()
    files = source_files(roots)
    random.Random(seed).shuffle(files)
    held, kept, seen_code = heldout_index(heldout_files, threshold), NearDuplicates(threshold), NearDuplicates(threshold)
    rows, dropped = [], {"too long": 0, "no docstring": 0, "held-out duplicate": 0, "duplicate": 0}
    for path in files:
        for fn, code in functions(path):
            if len(rows) >= count:
                break
            digest = hashlib.sha256(f"{seed}:{code}".encode()).digest()
            name, build = TASKS[digest[0] % len(TASKS)]
            prompt = build(fn, code)
            why = ("no docstring" if not prompt else "too long" if len(prompt) > MAX_CHARS
                   else "held-out duplicate" if held.match(prompt)
                   else "duplicate" if kept.match(prompt) or seen_code.match(code) else "")
            if why:
                dropped[why] += 1
                continue
            kept.add(prompt)
            seen_code.add(code)  # the same function (nearly) under another request is a repeat too
            root = next(r for r in roots if path.is_relative_to(r))
            rows.append({"id": f"code-py-{len(rows) + 1}", "category": "code", "split": split_of(prompt, heldout_share),
                         "prompt": prompt, "task": name, "source": f"{path.relative_to(root)}:{fn.lineno}"})
        if len(rows) >= count:
            break
    return rows, {"written": len(rows), "files": len(files), "dropped": dropped}


def write(rows: list[dict], out: Path) -> None:
    """`rows` as JSONL at `out`, written whole to a temporary file first."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(out)
