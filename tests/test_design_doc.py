"""docs/design.md stays the map of the code: every registered drafter kind (and `auto`) is described there,
and every learned kind's bundle folder is in its bundle listing."""

from __future__ import annotations

import re
from pathlib import Path

from specrt.kinds import AUTO, kinds, learned_kinds

DESIGN = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()


def test_every_registered_kind_is_described():
    missing = [name for name in [*kinds(), AUTO] if f"`{name}`" not in DESIGN]
    assert not missing, f"docs/design.md does not describe the kinds {missing}: add them where the kinds are listed"


def test_every_learned_kind_has_its_bundle_folder_listed():
    listed = set(re.findall(r"^├── (\w+)/", DESIGN, flags=re.M))
    missing = [name for name in learned_kinds() if name not in listed]
    assert not missing, f"docs/design.md's bundle listing lacks the folders of {missing}"
