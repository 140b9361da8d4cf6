"""`--backend auto` (the default): native where it runs the bundle here, else ort, with one line saying why
an int4 bundle fell back; a named backend is taken as named."""

from __future__ import annotations

import pytest

from specrt.engines import registry
from specrt.engines.native import library
from specrt.errors import SpecrtError
from specrt.schema.manifest import Manifest
from tests.helpers import export_tiny


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    return export_tiny(tmp_path_factory.mktemp("auto-int4"), "llama")


def resolve(bundle, requested="auto"):
    return registry.resolve_backend(requested, bundle, Manifest.load(bundle))


def test_an_int4_bundle_runs_native_and_the_generator_says_so(int4):
    from specrt.runtime.generate import Generator

    if library.available()[-1] == "scalar":
        pytest.skip("this CPU has no AVX2: auto takes ort (the next test covers that branch)")
    assert resolve(int4) == ("native", "")
    gen = Generator(int4, "ngram", max_seq_len=64)
    assert gen.backend == "native" and gen.notes == []
    assert gen.target.kernel_record["value"] == library.available()[-1]


def test_a_cpu_with_only_the_scalar_kernel_takes_ort_saying_why(int4, monkeypatch):
    monkeypatch.setattr(library, "available", lambda: ["scalar"])
    backend, note = resolve(int4)
    assert backend == "ort" and "no AVX2" in note and note.count("\n") == 0


def test_no_compiler_takes_ort_saying_why(int4, monkeypatch):
    def refuse():
        raise SpecrtError("the native backend compiles its kernels on first use and no C++ compiler was found "
                          "(set CXX, or `apt-get install g++`); --backend ort runs without one")

    monkeypatch.setattr(library, "available", refuse)
    backend, note = resolve(int4)
    assert backend == "ort" and "no C++ compiler was found" in note


def test_a_float_bundle_takes_ort_without_a_note(tmp_path):
    assert resolve(export_tiny(tmp_path, "llama", quantize=None)) == ("ort", "")


def test_a_family_native_does_not_compute_takes_ort_naming_it(tmp_path):
    backend, note = resolve(export_tiny(tmp_path, "qwen3"))
    assert backend == "ort" and "qk-norm" in note


def test_a_named_backend_is_taken_as_named_and_a_bad_one_refused(int4):
    assert resolve(int4, "ort") == ("ort", "")
    with pytest.raises(SpecrtError, match="unknown backend 'onnx'"):
        resolve(int4, "onnx")


def test_native_exactness_records_are_keyed_by_the_kernel_sources(monkeypatch):
    """A record measured with other kernel sources (an older specrt) never answers for these kernels."""
    from specrt.runtime.machine import Fingerprint

    now = Fingerprint.here(2, "native")
    assert now.backend.startswith("native (kernels ") and Fingerprint.here(2, "ort").backend == "ort"
    monkeypatch.setattr(library, "FILES", library.FILES[:-1])  # other sources, another digest
    assert Fingerprint.here(2, "native").key != now.key
