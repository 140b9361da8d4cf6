"""README.md is the user's page: short, with every drafter and backend specrt registers, the commands CI runs,
and links that resolve."""

from __future__ import annotations

import re
from pathlib import Path

from specrt.engines.registry import BACKENDS
from specrt.kinds import AUTO, kinds, runtime_drafters
from tests.markdown import markdown_section

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAX_LINES = 260


def test_readme_is_short():
    lines = len(README.splitlines())
    assert lines <= MAX_LINES, (f"README.md has {lines} lines, more than {MAX_LINES}: move measurements and long "
                                "explanations to docs/ and link them")


def test_every_registered_kind_is_in_the_drafter_list():
    listed = markdown_section(README, "Drafters")
    bullets = set(re.findall(r"^- `([\w-]+)`", listed, flags=re.M))
    missing = [name for name in [*kinds(), AUTO] if name not in bullets]
    assert not missing, f"README.md's Drafters list has no bullet for the kinds {missing}"
    runtime = [name for name in runtime_drafters() if f"`{name}`" not in listed]
    assert not runtime, f"README.md's Drafters section does not name the drafters {runtime}"


def test_every_backend_is_named():
    listed = markdown_section(README, "Backends")
    missing = [name for name in BACKENDS if f"`{name}`" not in listed]
    assert not missing, f"README.md's Backends section lacks {missing}"


def test_the_commands_ci_runs_are_in_the_readme():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith(("#", "set ", "cd "))]
    assert ci, ".ci/run runs no command"
    missing = [cmd for cmd in ci if cmd not in README]
    assert not missing, f"README.md does not show the commands .ci/run runs: {missing}"
    recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), flags=re.M)
    assert recipe, "the Makefile has no test target"
    pytest_line = recipe.group(1).strip().replace("$(PY)", ".venv/bin/python")
    assert pytest_line in README, f"README.md does not show `make test`'s command line {pytest_line!r}"


def test_local_links_resolve():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    broken = [t for t in targets if not t.startswith(("http://", "https://")) and not (ROOT / t).exists()]
    assert not broken, f"README.md links to missing files {broken}"
