"""Is a file named *.safetensors really one? Its header is read and checked (8-byte little-endian length,
then a JSON object) before any reader sees it, so a pickle or zip archive under that name gets a clear
error, and nothing is ever unpickled."""

from __future__ import annotations

import json
from pathlib import Path

from specrt.errors import SpecrtError

MAX_HEADER = 100 << 20  # the safetensors format's own limit on the JSON header
FORMATS = ((b"\x80", "a Python pickle, which specrt never unpickles"),
           (b"PK\x03\x04", "a zip archive, as torch.save writes: specrt never unpickles weights"),
           (b"GGUF", "a GGUF file"))


def check_safetensors(path: Path, fix: str = "convert it to safetensors in a trusted environment") -> None:
    """Raise a SpecrtError naming `path` unless it starts with a valid safetensors header."""
    why = _problem(Path(path))
    if why:
        raise SpecrtError(f"{path} is not a safetensors file ({why}): {fix}")


def check_folder(folder: Path, fix: str = "convert it to safetensors in a trusted environment") -> None:
    """`check_safetensors` for every *.safetensors file in `folder`."""
    for f in sorted(Path(folder).glob("*.safetensors")):
        check_safetensors(f, fix)


def _problem(path: Path) -> str | None:
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            header = f.read(n) if 1 < n <= min(MAX_HEADER, size - 8) else b""
    except OSError as e:
        return f"cannot read it: {e.strerror}"
    meta = None
    try:
        meta = json.loads(header) if header else None
    except ValueError:  # UnicodeDecodeError is a ValueError too
        pass
    if isinstance(meta, dict):  # a valid header first: its length's low byte may well be 0x80, a pickle's mark
        return None
    known = next((what for magic, what in FORMATS if head.startswith(magic)), None)
    if known:
        return f"it is {known}"
    if not header:
        return f"{size} bytes, no safetensors header" if size >= 8 else f"only {size} bytes"
    return "its header is not a JSON object" if meta is not None else "its header is not JSON"
