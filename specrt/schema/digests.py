"""SHA-256 of bundle files, remembered by (path, size, mtime_ns) so an unchanged bundle is hashed once.

The cache is one small JSON file (`specrt.paths.cache_dir()/sha256.json`): {resolved path: {"size",
"mtime_ns", "sha256"}}. A file whose size or modification time changed is hashed again; `full=True`
(the CLI's --verify) hashes every file whatever the cache says. Losing the cache costs only time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

CACHE_NAME = "sha256.json"
MAX_ENTRIES = 1024  # oldest dropped first; a bundle has a few dozen files


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_digests(*files: Path) -> dict[str, str]:
    """{file name: SHA-256}: what the manifest records for a graph's files."""
    return {Path(f).name: sha256_file(f) for f in files}


class DigestCache:
    """Digests of files by (resolved path, size, mtime_ns), read from and saved to `file`."""

    def __init__(self, file: Path):
        self.file = Path(file)
        self.entries = _read(self.file)
        self.hashed: list[Path] = []  # files hashed by this instance (not answered from the cache)

    def digest(self, path: Path, full: bool = False) -> str:
        """The SHA-256 of `path`: from the cache when its size and mtime are those recorded (unless `full`)."""
        st = path.stat()
        key = str(path.resolve())
        hit = self.entries.get(key)
        if not full and _fresh(hit, st):
            return hit["sha256"]
        digest = sha256_file(path)
        self.entries.pop(key, None)  # re-inserted last: the newest entries survive the size limit
        self.entries[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        self.hashed.append(path)
        return digest

    def save(self) -> None:
        """Write the cache (merged with what other processes saved meanwhile), atomically; a cache that
        cannot be written is skipped: it only saves time."""
        if not self.hashed:
            return
        merged = {**_read(self.file), **self.entries}
        kept = dict(list(merged.items())[-MAX_ENTRIES:])
        tmp = self.file.with_name(f"{self.file.name}.{os.getpid()}.tmp")
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(kept))
            tmp.replace(self.file)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()


def _fresh(hit: object, st: os.stat_result) -> bool:
    return (isinstance(hit, dict) and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns
            and isinstance(hit.get("sha256"), str))


def _read(file: Path) -> dict:
    try:
        d = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}
