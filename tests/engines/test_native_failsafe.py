"""The native backend fails safe: a manifest that does not describe its weights, a damaged cached library, a
compiler or cache that cannot be used, a thread count the system will not start, a hard-linked bundle. Each
is a one-line error naming what is wrong and the fix (or, under `--backend auto`, ONNX Runtime with a one-line
note), never a signal, a traceback or a model of other shapes run silently. The C entry points check every
size they are given, so a wrong call from Python is an error too."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specrt.engines.native import calls, library, weights
from specrt.engines.tables import EmbeddingTable
from tests.helpers import export_tiny

PROMPT = ("--prompt", "t1 t2 t3 t4", "--raw", "--max-new-tokens", "4", "--max-seq-len", "64", "--drafter", "plain")


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    return export_tiny(tmp_path_factory.mktemp("failsafe"), "llama")


def specrt(*args, env=None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from specrt.cli import main; main()", *map(str, args)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})}, cwd=cwd)


def one_line_error(proc, *needles) -> str:
    """The process exited 1 (not a signal) with one `specrt: error:` line holding every needle."""
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("specrt: error:"), proc.stderr[-2000:]
    for n in needles:
        assert n in lines[-1], lines[-1]
    return lines[-1]


def edited_copy(bundle: Path, dst: Path, edit) -> Path:
    shutil.copytree(bundle, dst)
    path = dst / "manifest.json"
    d = json.loads(path.read_text())
    edit(d["graphs"]["target"]["config"])
    path.write_text(json.dumps(d))
    return dst


def _set(**values):
    return lambda cfg: cfg.update(values)


# the tiny llama: vocab 128, hidden 64, intermediate 96, 2 layers, 4 heads of 16, 2 KV heads
@pytest.mark.parametrize("field,edit", [
    ("vocab_size", _set(vocab_size=200)),  # was a segfault: the embedding copied past its end
    ("hidden_size", _set(hidden_size=48)),  # was heap corruption (free(): invalid next size)
    ("intermediate_size", _set(intermediate_size=128)),  # was garbage text, exit 0
    ("num_heads / num_kv_heads / head_dim", _set(num_kv_heads=4)),
    ("num_heads / num_kv_heads / head_dim", _set(num_heads=2)),
    ("num_layers", _set(num_layers=1)),  # was a model of one layer, run silently
    ("num_layers", _set(num_layers=3)),
])
def test_a_manifest_that_does_not_describe_its_weights_is_named_by_field(int4, tmp_path, field, edit):
    bundle = edited_copy(int4, tmp_path / "b", edit)
    for backend in ("native", "auto"):
        one_line_error(specrt("generate", bundle, *PROMPT, "--backend", backend),
                       f"target {field} is", "decoder.onnx holds", "restore manifest.json or export the bundle again")


def test_shapes_are_checked_before_the_library_is_called(int4, monkeypatch):
    """weights.read refuses the mismatch itself: the C side is never reached with a wrong config."""
    from specrt.errors import SpecrtError
    from specrt.schema.manifest import Manifest

    manifest = Manifest.load(int4)
    cfg = dataclasses.replace(manifest.target.config, vocab_size=manifest.target.config.vocab_size + 1)
    monkeypatch.setattr(library, "load", lambda: pytest.fail("the library was called"))
    with pytest.raises(SpecrtError, match=r"vocab_size is 129 but .* an embedding table of 128 x 64"):
        weights.read(int4 / manifest.target.file, cfg)


class TestTheCEntryPoints:
    """Calls with sizes that do not fit the model are refused by the library, one message each."""

    @pytest.fixture
    def model(self):
        lib = library.load()
        h = lib.spn_model_new(1, 64, 4, 2, 16, 96, 128, 1e-6, 1.0, 0, 1, 0)
        assert h, library.last_error()
        yield lib, h
        lib.spn_model_free(h)

    def test_tables_and_norms_of_the_wrong_size(self, model):
        lib, h = model
        assert not calls.use_embed(lib, h, EmbeddingTable(dense=np.zeros((200, 64), np.float32)))
        assert "embedding table 200 x 64 for a model of vocabulary x hidden 128 x 64" in library.last_error()
        codes, scales = np.zeros((128, 64), np.uint8), np.ones((128, 2), np.float32)
        assert not calls.use_embed(lib, h, EmbeddingTable(codes=codes, scales=scales, block=16))
        assert "8192 codes and 256 scales for an embedding table 128 x 64 in blocks of 16" in library.last_error()
        assert not calls.use_embed(lib, h, EmbeddingTable(codes=codes, scales=np.ones((128, 1), np.float32), block=64))
        assert "embedding blocks of 64 inputs for rows of 64" in library.last_error()
        assert calls.use_embed(lib, h, EmbeddingTable(codes=codes, scales=scales, block=32))
        assert not calls.set_norm(lib, h, 0, 0, np.ones(48, np.float32))
        assert "norm of 48 weights for hidden size 64" in library.last_error()
        assert not calls.set_norm(lib, h, 5, 0, np.ones(64, np.float32))
        assert "layer out of range" in library.last_error()
        cos = np.ones((10, 4), np.float32)
        assert not calls.set_rope(lib, h, cos, cos)
        assert "rotary table of 4 frequencies for head_dim 16" in library.last_error()
        assert not calls.set_taps(lib, h, [7])
        assert "tap layer 7 out of 0..1" in library.last_error()

    def test_projections_of_the_wrong_shape_or_size(self, model):
        lib, h = model

        def lin(k, n, blocks=None, scales=None):
            blocks = blocks if blocks is not None else -(-k // 32)
            return weights.Linear(k, n, np.zeros((n, blocks, 16), np.uint8),
                                  np.ones((n, scales if scales is not None else blocks), np.float32))

        assert calls.set_linear(lib, h, 0, 1, lin(64, 64)), library.last_error()  # o: [H·... = 64, 64]
        assert not calls.set_linear(lib, h, 0, 0, lin(64, 100))
        assert "layer 0 projection 0: weights 64 x 100 where the model's dimensions give 64 x 128" in library.last_error()
        assert not calls.set_linear(lib, h, 0, 3, lin(96, 64, blocks=2))  # down: 3 blocks of 32 needed
        assert "packed weights of 2048 bytes" in library.last_error()
        assert not calls.set_linear(lib, h, 0, 3, lin(96, 64, scales=1))
        assert "64 scales for" in library.last_error()
        assert not calls.set_linear(lib, h, -1, 0, lin(64, 100))
        assert "LM head: weights 64 x 100 where the model's dimensions give 64 x 128" in library.last_error()
        assert calls.linear_new(lib, lin(96, 64, blocks=2)) is None

    def test_a_pass_over_a_model_not_fully_set_is_refused(self, model):
        lib, h = model
        one = np.zeros((1, 1), np.int64)
        out = np.zeros(128, np.float32)
        kv = (ctypes.c_void_p * 2)(out.ctypes.data, out.ctypes.data)
        rc = lib.spn_pass(h, 1, 1, one.ctypes.data, one.ctypes.data, one.ctypes.data, np.ones(1, np.bool_).ctypes.data,
                          1, one.ctypes.data, kv, 64 * 16, 64, out.ctypes.data, out.ctypes.data, None)
        assert rc != 0 and "no embedding table set" in library.last_error()

    def test_a_drafter_mix_takes_only_its_own_weights(self, model):
        """A decoder has no feature norm or mix projection; EAGLE-3's concat mix no embedding norm or projection; a
        projected mix's P is 2H -> H; a mix code past the last is refused; a projected mix not given its P
        cannot run."""
        lib, h = model
        norm = np.ones(64, np.float32)
        proj = weights.Linear(128, 64, np.zeros((64, 4, 16), np.uint8), np.ones((64, 4), np.float32))
        assert not calls.set_norm(lib, h, 0, 3, norm)
        assert "only a drafter layer has a feature norm" in library.last_error()
        assert not calls.set_linear(lib, h, -1, 2, proj)
        assert "only a projected mix has a mix projection" in library.last_error()
        assert not lib.spn_model_new(1, 64, 4, 2, 16, 96, 128, 1e-6, 1.0, 0, 1, 3)
        assert "drafter mix 3 is not 0, 1 or 2" in library.last_error()
        concat = lib.spn_model_new(1, 64, 4, 2, 16, 96, 128, 1e-6, 1.0, 0, 1, 1)
        project = lib.spn_model_new(1, 64, 4, 2, 16, 96, 128, 1e-6, 1.0, 0, 1, 2)
        try:
            assert not calls.set_norm(lib, concat, 0, 4, norm)
            assert "only a projected mix has an embedding norm" in library.last_error()
            assert calls.set_norm(lib, project, 0, 4, norm) and calls.set_norm(lib, project, 0, 3, norm)
            assert not calls.set_linear(lib, project, -1, 2, dataclasses.replace(proj, n=32, q=proj.q[:32],
                                                                                 scales=proj.scales[:32]))
            assert "mix projection: weights 128 x 32 where the model's dimensions give 128 x 64" in library.last_error()
            assert calls.set_linear(lib, project, -1, 2, proj), library.last_error()
            assert calls.use_embed(lib, project, EmbeddingTable(dense=np.zeros((128, 64), np.float32)))
            fresh = lib.spn_model_new(1, 64, 4, 2, 16, 96, 128, 1e-6, 1.0, 0, 1, 2)
            assert calls.use_embed(lib, fresh, EmbeddingTable(dense=np.zeros((128, 64), np.float32)))
            one, f = np.zeros(1, np.int64), np.zeros((1, 64), np.float32)
            out = np.zeros(128, np.float32)
            kv = (ctypes.c_void_p * 2)(out.ctypes.data, out.ctypes.data)
            rc = lib.spn_feature_pass(fresh, 1, one.ctypes.data, f.ctypes.data, None, 0, one.ctypes.data,
                                      one.ctypes.data, np.ones(1, np.bool_).ctypes.data, 1, one.ctypes.data, kv, 8,
                                      out.ctypes.data, out.ctypes.data)
            assert rc != 0 and "no rotary table set" in library.last_error()
            cos = np.ones((16, 8), np.float32)
            assert calls.set_rope(lib, fresh, cos, cos)
            rc = lib.spn_feature_pass(fresh, 1, one.ctypes.data, f.ctypes.data, None, 0, one.ctypes.data,
                                      one.ctypes.data, np.ones(1, np.bool_).ctypes.data, 1, one.ctypes.data, kv, 8,
                                      out.ctypes.data, out.ctypes.data)
            assert rc != 0 and "no mix projection set" in library.last_error()
            lib.spn_model_free(fresh)
        finally:
            lib.spn_model_free(concat)
            lib.spn_model_free(project)

    def test_a_thread_count_past_the_limit_is_refused(self):
        lib = library.load()
        assert not lib.spn_model_new(1, 64, 4, 2, 16, 96, 128, 1e-6, 1.0, 0, 100000, 0)
        assert "threads 100000 outside 1..1024" in library.last_error()


THREADS_REFUSED = """
import resource, re
from specrt.engines.native import library
lib = library.load()
vm = int(re.search(r"VmSize:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (48 << 20), resource.RLIM_INFINITY))
h = lib.spn_model_new(1, 64, 4, 2, 16, 96, 128, 1e-6, 1.0, 0, 256, 0)
print("handle" if h else library.last_error())
"""


def test_threads_the_system_will_not_start_are_an_error_not_an_abort():
    """256 threads' stacks (8 MiB each) do not fit an address space 48 MiB larger than the process: creating
    them fails part way, and the threads already started are stopped and joined (a joinable thread destroyed
    would terminate the process)."""
    proc = subprocess.run([sys.executable, "-c", THREADS_REFUSED], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("could not start 256 threads"), proc.stdout


def test_threads_past_the_cpus_get_a_warning(int4, monkeypatch):
    from specrt.runtime import target
    from specrt.runtime.generate import Generator
    from specrt.runtime.machine import threads_note

    assert threads_note(2, 2) == ""
    monkeypatch.setattr(target, "usable_cpus", lambda: 2)
    gen = Generator(int4, "plain", max_seq_len=64, threads=3, backend="native")
    assert gen.notes == ["warning: --threads 3 is more than the 2 CPUs this process may use: threads past the "
                         "CPUs wait on each other and every pass slows down; --threads 2 is the most that helps"]
    assert Generator(int4, "plain", max_seq_len=64, threads=2, backend="native").notes == []


def test_a_thread_count_past_the_native_limit_is_one_line(int4):
    """--threads 100000 ran 21 s, then `terminate called ... std::system_error` (exit 134)."""
    one_line_error(specrt("generate", int4, *PROMPT, "--backend", "native", "--threads", "100000"),
                   "--threads 100000: the native backend runs 1 to 1024 threads", "use --threads")


FAKE_CXX = """#!/bin/sh
# a compiler that writes the library this test built: `-o OUT` is the output; counts its runs
while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
echo run >> "$(dirname "$0")/runs"
cp "{lib}" "$out"
"""


@pytest.fixture
def fake_cxx(tmp_path, monkeypatch):
    """SPECRT_HOME in tmp_path, and CXX a script that 'compiles' by copying this machine's library (the cache
    path is keyed by CXX, so this one is the test's own)."""
    script = tmp_path / "bin" / "fake-g++"
    script.parent.mkdir()
    script.write_text(FAKE_CXX.format(lib=library.build()))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    env = {"SPECRT_HOME": str(tmp_path / "home"), "CXX": str(script)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env, script.parent / "runs"


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_damaged_cached_library_is_built_again(int4, fake_cxx, damage):
    """A truncated library was a bus error (exit 135) at dlopen; garbage or empty was a traceback and never
    rebuilt. The build records its size and digest; a file that does not match is built again."""
    env, runs = fake_cxx
    path = library.build()
    assert runs.read_text().count("run") == 1 and library._verified(path)
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 3], "garbage": os.urandom(len(data)), "empty": b""}[damage])
    assert not library._verified(path)
    proc = specrt("generate", int4, *PROMPT, "--backend", "native", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "the cached one failed its check" in proc.stderr
    assert runs.read_text().count("run") == 2 and library._verified(path) and path.read_bytes() == data
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.name + ".json"]  # nothing half-written


def test_a_compiler_that_cannot_run_is_one_line_and_auto_takes_ort(int4, tmp_path):
    env = {"SPECRT_HOME": str(tmp_path / "home"), "CXX": "/nonexistent/g++"}
    one_line_error(specrt("generate", int4, *PROMPT, "--backend", "native", env=env),
                   "the C++ compiler /nonexistent/g++ could not be run", "set CXX")
    proc = specrt("generate", int4, *PROMPT, "--backend", "auto", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "note: --backend auto runs ort: the native backend cannot run here (the C++ compiler" in proc.stderr
    assert not list((tmp_path / "home").rglob("*.so*"))  # nothing half-written


def test_every_kernel_source_is_in_the_digest():
    """The cached library is keyed by its sources' digest: a source left out of library.FILES (a header added
    later) would let a library built from its old text answer for the new one."""
    assert sorted(library.FILES) == sorted(p.name for p in library.SOURCES.iterdir() if p.is_file())
    assert set(library.UNITS) <= set(library.FILES)


def test_a_cache_that_cannot_be_written_is_one_line(monkeypatch, tmp_path):
    """The cache folder cannot be made (its parent is a file: a read-only cache behaves alike)."""
    from specrt.errors import SpecrtError

    (tmp_path / "file").write_text("")
    monkeypatch.setattr(library, "library_path", lambda cxx: tmp_path / "file" / "native" / library.LIB_NAME)
    with pytest.raises(SpecrtError, match=r"the native kernels' cache .*file/native is not writable .*set SPECRT_HOME"):
        library.build()


def test_a_hard_linked_copy_of_a_bundle_runs_as_the_bundle(int4, tmp_path):
    """`cp -al`: onnx's external-data loader refused a data file with two links; the native backend maps the
    data itself (engines/tables.py), as ONNX Runtime reads it."""
    copy = tmp_path / "linked"
    shutil.copytree(int4, copy, copy_function=os.link)
    assert (copy / "target" / "decoder.onnx.data").stat().st_nlink == 2
    runs = [specrt("generate", b, *PROMPT, "--backend", "native", "--json") for b in (int4, copy)]
    for proc in runs:
        assert proc.returncode == 0, proc.stderr[-2000:]
    ids = [json.loads(p.stdout.splitlines()[-1])["token_ids"] for p in runs]
    assert ids[0] == ids[1] and len(ids[0]) == 4
