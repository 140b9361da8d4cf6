"""Which drafter kinds each test covers, for tests/test_kind_coverage.py.

A test declares what it checks with `@pytest.mark.covers(ASPECT)`; the kind comes from the test's
`kind` or `drafter` parameter (a runtime drafter name counts for its kind), or from
`@pytest.mark.covers(ASPECT, kinds=(...))`.

A run that collects the whole suite has the answer already: tests/conftest.py hands every collected file and
item to `collected_file` / `collected_item`, and `whole_suite_coverage` reads it (before any -k or -m
deselection, as a collection of the whole suite alone gives it). Otherwise, loaded as a plugin by a
`--collect-only` run, this writes {aspect: [kinds]} to the file named by $SPECRT_KIND_COVERAGE.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

_FILES: set[str] = set()  # the test files this process's collection reached (node ids, relative to the root)
_COVERAGE: dict[str, set[str]] = {}


def kinds_of(item) -> set[str]:
    from specrt.kinds import kinds, runtime_drafters

    params = getattr(item, "callspec", None)
    params = params.params if params else {}
    named = {params[p] for p in ("kind", "drafter") if isinstance(params.get(p), str)}
    table = runtime_drafters()
    return {table[n].name if n in table else n for n in named if n in table or n in kinds()}


def add(item, out: dict[str, set[str]]) -> None:
    for mark in item.iter_markers("covers"):
        out.setdefault(mark.args[0], set()).update(mark.kwargs.get("kinds", ()) or kinds_of(item))


def as_json(out: dict[str, set[str]]) -> dict[str, list[str]]:
    return {k: sorted(v) for k, v in out.items()}


def collected_file(report) -> None:
    if report.nodeid.endswith(".py") and not report.failed:  # a module skipped whole holds no test either way
        _FILES.add(report.nodeid)


def collected_item(item) -> None:
    add(item, _COVERAGE)


def whole_suite_coverage(root: Path) -> dict[str, list[str]] | None:
    """{aspect: [kinds]} from this process's own collection where it reached every test file under
    `root`/tests; None where it did not (a run of some files only)."""
    every = {p.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py")}
    return as_json(_COVERAGE) if every <= _FILES else None


def pytest_collection_modifyitems(session, config, items):
    out: dict[str, set[str]] = {}
    for item in items:
        add(item, out)
    with open(os.environ["SPECRT_KIND_COVERAGE"], "w") as f:
        json.dump(as_json(out), f)
