"""Field checks for the JSON specrt reads back (manifest.json, drafter configs): each document's fields
map to one `Check` in a table, so a wrong type or range names the field, what it must be and the value.

    check_fields(doc, {"num_layers": POSITIVE_INT, ...}, prefix="graphs.target.config.")
    -> FieldError: graphs.target.config.num_layers must be a positive integer, got '30'
"""

from __future__ import annotations

import math
import numbers
import posixpath
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass


class FieldError(ValueError):
    """Field `key` (dotted path in the document) is missing or fails its check."""

    def __init__(self, key: str, expected: str, value: object = None, missing: bool = False):
        self.key = key
        shown = "nothing (the field is missing)" if missing else _show(value)
        super().__init__(f"{key} must be {expected}, got {shown}")


def _show(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(frozen=True)
class Check:
    expected: str  # the words after "must be": "a positive integer"
    accepts: Callable[[object], bool]

    def __call__(self, key: str, value: object) -> None:
        if not self.accepts(value):
            raise FieldError(key, self.expected, value)


def is_int(v: object) -> bool:
    """An integer (numpy's too); true/false are not."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_number(v: object) -> bool:
    """A finite real number, int or float (JSON writes 1.0 as 1 sometimes; true/false are not numbers)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def is_bundle_path(v: object) -> bool:
    """A relative path that stays inside the folder it is relative to ('../x' and '/x' do not)."""
    if not isinstance(v, str) or not v or "\x00" in v or "\\" in v or v.startswith("/") or re.match(r"^[A-Za-z]:", v):
        return False
    norm = posixpath.normpath(v)
    return norm != "." and norm != ".." and not norm.startswith("../")


def is_file_name(v: object) -> bool:
    return isinstance(v, str) and is_bundle_path(v) and "/" not in v


def list_of(item: Callable[[object], bool], non_empty: bool = False) -> Callable[[object], bool]:
    return lambda v: isinstance(v, list) and (bool(v) or not non_empty) and all(item(x) for x in v)


POSITIVE_INT = Check("a positive integer", lambda v: is_int(v) and v > 0)
NON_NEGATIVE_INT = Check("an integer >= 0", lambda v: is_int(v) and v >= 0)
POSITIVE_NUMBER = Check("a positive finite number", lambda v: is_number(v) and v > 0)
BOOL = Check("true or false", lambda v: isinstance(v, bool))
TEXT = Check("a string", lambda v: isinstance(v, str))
NON_EMPTY_TEXT = Check("a non-empty string", lambda v: isinstance(v, str) and bool(v))
OPTIONAL_TEXT = Check("a string or null", lambda v: v is None or isinstance(v, str))
OBJECT = Check("an object", lambda v: isinstance(v, dict))
TEXT_LIST = Check("a list of strings", list_of(lambda x: isinstance(x, str)))
INT_LIST = Check("a list of integers >= 0", list_of(lambda x: is_int(x) and x >= 0))
BUNDLE_PATH = Check("a relative path inside the bundle", is_bundle_path)
DIGESTS = Check("an object of file name -> sha256 hex digest",
                lambda v: isinstance(v, dict) and all(is_file_name(k) and isinstance(d, str)
                                                      and re.fullmatch(r"[0-9a-f]{64}", d) for k, d in v.items()))


def check_fields(doc: dict, table: dict[str, Check], prefix: str = "", optional: Collection[str] = ()) -> None:
    """Apply each field's check; a field not in `doc` is an error unless it is `optional`. Fields the
    table does not name are left alone (later specrt versions may add some)."""
    for name, check in table.items():
        if name in doc:
            check(prefix + name, doc[name])
        elif name not in optional:
            raise FieldError(prefix + name, check.expected, missing=True)


def check_object(key: str, doc: object, table: dict[str, Check], optional: Collection[str] = ()) -> None:
    """`doc` must be an object (named `key`) whose fields pass `table`."""
    OBJECT(key, doc)
    check_fields(doc, table, f"{key}." if key else "", optional)
