"""Reading the project's markdown in tests."""

from __future__ import annotations

import re


def markdown_section(text: str, heading: str) -> str:
    """The text under the markdown heading `heading` (any level), up to the next heading of that level or higher."""
    match = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, flags=re.M)
    assert match, f"no heading {heading!r}"
    level = len(match.group(1))
    end = re.search(rf"^#{{1,{level}}} ", text[match.end():], flags=re.M)
    return text[match.end(): match.end() + end.start()] if end else text[match.end():]
