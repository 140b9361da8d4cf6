"""Bundle files are checked against the digests manifest.json records: changed bytes are an error naming the
file and both digests; an unchanged file is hashed once per machine (cached by size and mtime)."""

from __future__ import annotations

import json
import os

import pytest

from specrt.errors import SpecrtError
from specrt.schema.digests import CACHE_NAME, DigestCache, sha256_file
from specrt.schema.integrity import verify_bundle
from specrt.schema.manifest import Manifest
from tests.schema.bundles import write_bundle


@pytest.fixture
def bundle(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRT_HOME", str(tmp_path / "home"))  # the digest cache lives under it
    return write_bundle(tmp_path / "b")


def flip_byte(path, offset=100):
    """Change one byte in place, keeping the size and (optionally restored by the caller) the mtime."""
    with path.open("r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_an_intact_bundle_is_hashed_once_then_answered_from_the_cache(bundle, tmp_path):
    m = Manifest.load(bundle)
    first = verify_bundle(bundle, m)
    assert sorted(p.name for p in first) == ["decoder.onnx", "decoder.onnx.data"]
    assert (tmp_path / "home" / "cache" / CACHE_NAME).is_file()
    assert verify_bundle(bundle, m) == []  # nothing re-hashed
    assert len(verify_bundle(bundle, m, full=True)) == 2  # --verify hashes everything again


def test_flipped_bytes_name_the_file_and_both_digests(bundle):
    m = Manifest.load(bundle)
    verify_bundle(bundle, m)  # cached while intact
    data = bundle / "target" / "decoder.onnx.data"
    expected = m.target.sha256["decoder.onnx.data"]
    flip_byte(data)
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 1_000_000))  # a later write
    with pytest.raises(SpecrtError) as e:
        verify_bundle(bundle, m)
    message = str(e.value)
    assert str(data) in message and expected in message and sha256_file(data) in message
    assert "graphs.target.sha256" in message and message.endswith("re-export or re-copy the bundle")


def test_verify_rehashes_a_file_the_cache_would_trust(bundle):
    """Same size, same mtime (a copy tool that preserves times, a bit flip on disk): only --verify sees it."""
    m = Manifest.load(bundle)
    verify_bundle(bundle, m)
    data = bundle / "target" / "decoder.onnx"
    st = data.stat()
    flip_byte(data)
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert verify_bundle(bundle, m) == []  # the fast path: size and mtime unchanged
    with pytest.raises(SpecrtError, match="decoder.onnx is corrupt or was changed"):
        verify_bundle(bundle, m, full=True)


def test_a_missing_file_is_named_with_its_manifest_key(bundle):
    (bundle / "target" / "decoder.onnx.data").unlink()
    with pytest.raises(SpecrtError, match=r"decoder.onnx.data is missing \(manifest.json records its sha256 in "
                                          r"graphs.target.sha256\): re-export or re-copy the bundle"):
        verify_bundle(bundle, Manifest.load(bundle))


def test_built_artifacts_with_digests_are_verified_too(bundle):
    built = bundle / "target" / "decoder.ort-opt.onnx"
    built.write_bytes(b"optimized graph")
    d = json.loads((bundle / "manifest.json").read_text())
    d["artifacts"]["onnxruntime"] = {"graphs": {"target": {"file": "target/decoder.ort-opt.onnx",
                                                           "sha256": {built.name: "0" * 64}}}}
    (bundle / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(SpecrtError, match="artifacts.onnxruntime.graphs.target.sha256"):
        verify_bundle(bundle, Manifest.load(bundle))


def test_a_damaged_cache_costs_a_rehash_not_an_error(bundle, tmp_path):
    cache = tmp_path / "home" / "cache" / CACHE_NAME
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    assert len(verify_bundle(bundle, Manifest.load(bundle))) == 2
    assert len(json.loads(cache.read_text())) == 2
    entries = json.loads(cache.read_text())
    entries[str((bundle / "target" / "decoder.onnx").resolve())]["sha256"] = ["not", "a", "digest"]
    cache.write_text(json.dumps(entries))
    assert [p.name for p in verify_bundle(bundle, Manifest.load(bundle))] == ["decoder.onnx"]


def test_the_cache_is_skipped_where_it_cannot_be_written(bundle, tmp_path):
    (tmp_path / "ro").write_text("a file where the cache folder would be")
    cache = DigestCache(tmp_path / "ro" / CACHE_NAME)
    assert len(verify_bundle(bundle, Manifest.load(bundle), cache=cache)) == 2
