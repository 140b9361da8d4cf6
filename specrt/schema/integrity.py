"""A bundle's files against the SHA-256 digests its manifest records (written by export and `specrt build`).

    verify_bundle(bundle, manifest)             every recorded file present with its recorded digest; digests
                                                of files unchanged since they were last hashed (same size and
                                                mtime) come from the cache (schema/digests.py)
    verify_bundle(bundle, manifest, full=True)  the same, every file hashed again (the CLI's --verify)
"""

from __future__ import annotations

import posixpath
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.schema.digests import CACHE_NAME, DigestCache

FIX = "re-export or re-copy the bundle"


def recorded_digests(manifest) -> list[tuple[str, str, str]]:
    """(manifest key, path relative to the bundle, expected sha256) of every file the manifest hashes:
    each graph's files, and the files `specrt build` wrote for ONNX Runtime."""
    entries = [(f"graphs.{role}", g.file, g.sha256) for role, g in manifest.graphs.items()]
    built = manifest.artifacts.get("onnxruntime", {})
    for section in ("graphs", "fused", "fused_batched"):
        entries += [(f"artifacts.onnxruntime.{section}.{role}", b["file"], b.get("sha256", {}))
                    for role, b in built.get(section, {}).items()]
    return [(f"{key}.sha256", posixpath.join(posixpath.dirname(file), name), digest)
            for key, file, digests in entries for name, digest in digests.items()]


def verify_bundle(bundle: Path, manifest, full: bool = False, cache: DigestCache | None = None) -> list[Path]:
    """Raise a SpecrtError naming the first file that is missing or differs from its recorded digest;
    returns the files that had to be hashed (the others were answered from the cache)."""
    from specrt.paths import cache_dir

    cache = cache or DigestCache(cache_dir() / CACHE_NAME)
    try:
        for key, rel, expected in recorded_digests(manifest):
            _check(Path(bundle) / rel, key, expected, cache, full)
    finally:
        cache.save()
    return cache.hashed


def _check(path: Path, key: str, expected: str, cache: DigestCache, full: bool) -> None:
    if not path.is_file():
        raise SpecrtError(f"{path} is missing (manifest.json records its sha256 in {key}): {FIX}")
    try:
        actual = cache.digest(path, full)
    except OSError as e:
        raise SpecrtError(f"cannot read {path} ({e.strerror}): check its permissions, or {FIX}") from None
    if actual != expected:
        raise SpecrtError(f"{path} is corrupt or was changed: sha256 {actual}, expected {expected} "
                          f"(manifest.json {key}): {FIX}")
