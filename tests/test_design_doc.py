"""docs/design.md stays the map of the code: every registered drafter kind (and `auto`), every runtime drafter
name and every backend is described there, and every learned kind's bundle folder is in its bundle listing."""

from __future__ import annotations

import re
from pathlib import Path

from specrt.engines.registry import BACKENDS
from specrt.kinds import AUTO, kinds, learned_kinds, runtime_drafters
from tests.markdown import markdown_section

DESIGN = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()


def test_every_registered_kind_is_described():
    missing = [name for name in [*kinds(), AUTO] if f"`{name}`" not in DESIGN]
    assert not missing, f"docs/design.md does not describe the kinds {missing}: add them where the kinds are listed"


def test_every_drafter_name_is_in_the_drafters_section():
    listed = markdown_section(DESIGN, "Drafters")
    missing = [name for name in [*kinds(), *runtime_drafters(), AUTO] if f"`{name}`" not in listed]
    assert not missing, f"docs/design.md's Drafters section lacks {missing}"


def test_every_backend_is_in_the_backends_section():
    listed = markdown_section(DESIGN, "Backends")
    missing = [name for name in BACKENDS if f"`{name}`" not in listed]
    assert not missing, f"docs/design.md's Backends section lacks the backends {missing}"


def test_every_learned_kind_has_its_bundle_folder_listed():
    listed = set(re.findall(r"^├── (\w+)/", DESIGN, flags=re.M))
    missing = [name for name in learned_kinds() if name not in listed]
    assert not missing, f"docs/design.md's bundle listing lacks the folders of {missing}"
