"""Which drafter kinds each test covers, for tests/test_kind_coverage.py.

A test declares what it checks with `@pytest.mark.covers(ASPECT)`; the kind comes from the test's
`kind` or `drafter` parameter (a runtime drafter name counts for its kind), or from
`@pytest.mark.covers(ASPECT, kinds=(...))`. Loaded as a plugin by a `--collect-only` run, this
writes {aspect: [kinds]} to the file named by $SPECRT_KIND_COVERAGE.
"""

from __future__ import annotations

import json
import os


def kinds_of(item) -> set[str]:
    from specrt.kinds import kinds, runtime_drafters

    params = getattr(item, "callspec", None)
    params = params.params if params else {}
    named = {params[p] for p in ("kind", "drafter") if isinstance(params.get(p), str)}
    table = runtime_drafters()
    return {table[n].name if n in table else n for n in named if n in table or n in kinds()}


def pytest_collection_modifyitems(session, config, items):
    out: dict[str, set[str]] = {}
    for item in items:
        for mark in item.iter_markers("covers"):
            aspect = mark.args[0]
            out.setdefault(aspect, set()).update(mark.kwargs.get("kinds", ()) or kinds_of(item))
    with open(os.environ["SPECRT_KIND_COVERAGE"], "w") as f:
        json.dump({k: sorted(v) for k, v in out.items()}, f)
