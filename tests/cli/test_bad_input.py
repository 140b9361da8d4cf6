"""Bad input: non-zero exit, one line naming the problem, and no half-written bundle."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import save_tiny_folder


def specrt(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from specrt.cli import main; main()", *map(str, args)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


def assert_one_line_error(proc, *needles):
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("specrt: error:"), proc.stderr[-1500:]
    assert "Traceback" not in proc.stderr, proc.stderr[-1500:]
    for n in needles:
        assert n in lines[-1], lines[-1]


def assert_nothing_written(parent: Path):
    leftovers = [p.name for p in parent.iterdir()] if parent.exists() else []
    assert leftovers == [], f"half-written output left behind: {leftovers}"


def test_missing_model_path(tmp_path):
    out = tmp_path / "out"
    proc = specrt("export", "--model", tmp_path / "nope", "-o", out / "b")
    assert_one_line_error(proc, "nope", "does not exist")
    assert_nothing_written(out)


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "m" / "model.gguf"
    bad.parent.mkdir()
    bad.write_bytes(b"not a gguf at all" * 100)
    out = tmp_path / "out"
    proc = specrt("export", "--model", bad, "-o", out / "b")
    assert_one_line_error(proc, "model.gguf", "not a GGUF")
    assert_nothing_written(out)


def test_truncated_gguf(tmp_path, default_gguf):
    bad = tmp_path / "m" / "cut.gguf"
    bad.parent.mkdir()
    with default_gguf.open("rb") as f:
        bad.write_bytes(f.read(4096))  # right magic, cut short
    out = tmp_path / "out"
    proc = specrt("export", "--model", bad, "-o", out / "b")
    assert_one_line_error(proc, "cut.gguf")
    assert_nothing_written(out)


def test_vocab_mismatch_is_refused(tmp_path, tokenizer_dir):
    target = save_tiny_folder(tmp_path / "target", "llama", tokenizer_dir, vocab_size=49152)
    draft = save_tiny_folder(tmp_path / "draft", "llama", tokenizer_dir, vocab_size=1000)
    out = tmp_path / "out"
    proc = specrt("export", "--model", target, "--draft-model", draft, "-o", out / "b", "--no-parity-check")
    assert_one_line_error(proc, "draft vocab 1000", "target vocab 49152", "tokenizer")
    assert_nothing_written(out)


def test_unsupported_family_is_refused(tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    proc = specrt("export", "--model", folder, "-o", tmp_path / "out" / "b")
    assert_one_line_error(proc, "gpt2", "not supported")


def test_corrupt_onnx_in_bundle(tmp_path, real_bundle):
    bundle = tmp_path / "b"
    shutil.copytree(real_bundle, bundle, ignore=shutil.ignore_patterns("*.data"))
    (bundle / "target" / "decoder.onnx").write_bytes(b"\x00garbage" * 64)
    proc = specrt("generate", bundle, "--prompt", "hi")
    assert_one_line_error(proc, "decoder.onnx", "export the bundle again")


def test_missing_bundle(tmp_path):
    proc = specrt("generate", tmp_path / "none", "--prompt", "hi")
    assert_one_line_error(proc, "none", "specrt export")


def test_prompt_longer_than_capacity(real_bundle):
    proc = specrt("generate", real_bundle, "--prompt", "word " * 200, "--max-seq-len", "64")
    assert_one_line_error(proc, "KV capacity is 64", "--max-seq-len")


def test_unknown_drafter(real_bundle):
    proc = specrt("generate", real_bundle, "--prompt", "hi", "--drafter", "medusa2")
    assert_one_line_error(proc, "medusa2", "plain")


def test_bad_prompts_file(tmp_path, real_bundle):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{not json}\n')
    proc = specrt("bench", real_bundle, "--prompts", f, "--drafters", "plain", "--max-new-tokens", "2")
    assert_one_line_error(proc, "p.jsonl:2")


def test_build_trt_without_tensorrt_says_what_to_install(real_bundle):
    from specrt.engines.trt.build import tensorrt_available

    if tensorrt_available():  # pragma: no cover - only where TensorRT exists
        pytest.skip("TensorRT is installed here; this test covers machines without it")
    proc = specrt("build", real_bundle, "--backend", "trt")
    assert_one_line_error(proc, "TensorRT is not installed", "pip install tensorrt")


def test_export_with_an_untrained_drafter_says_how_to_train_it(tmp_path):
    folder = save_tiny_folder(tmp_path / "m", "llama", None)
    out = tmp_path / "out"
    proc = specrt("export", "--model", folder, "-o", out / "b", "--drafter", "eagle",
                  env={"SPECRT_HOME": str(tmp_path / "home")})
    assert_one_line_error(proc, "no trained eagle drafter", "specrt train eagle")
    assert_nothing_written(out)


def test_export_drafter_weights_that_are_not_a_checkpoint(tmp_path):
    folder = save_tiny_folder(tmp_path / "m", "llama", None)
    (tmp_path / "ck").mkdir()
    out = tmp_path / "out"
    proc = specrt("export", "--model", folder, "-o", out / "b", "--drafter", "medusa", "--drafter-weights",
                  tmp_path / "ck")
    assert_one_line_error(proc, "ck", "config.json")
    assert_nothing_written(out)


def test_train_rejects_a_malformed_setting(tmp_path):
    proc = specrt("train", "medusa", "--set", "num_heads", "--target", tmp_path / "none")
    assert_one_line_error(proc, "--set", "KEY=VALUE")
