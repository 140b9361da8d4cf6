"""The ortgenai peer model's build (tools/peer_models.py), with the HF export and the builder stubbed:

- the builder's command line carries int4, CPU, block size and accuracy level;
- the model lands in $SPECRT_HOME/peers/ortgenai/<model>-int4 with its build record, once;
- a failing build leaves neither a model folder nor a temporary one, and says what the builder said.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from specrt.errors import SpecrtError
from specrt.tools import peer_models
from specrt.tools.peer_models import RECORD, build_ortgenai, is_built, ortgenai_dir

pytestmark = pytest.mark.skipif(importlib.util.find_spec("onnxruntime_genai") is None,
                                reason="onnxruntime-genai is not installed (pip install 'specrt[peers]')")


@pytest.fixture
def stubbed(tmp_path, monkeypatch):
    """A fake GGUF under a temporary SPECRT_HOME; the HF export writes a config, the 'builder' a model."""
    monkeypatch.setenv("SPECRT_HOME", str(tmp_path / "home"))
    source = tmp_path / "Tiny-1M.Q4_0.gguf"
    source.write_bytes(b"GGUF")
    calls = []

    def save_hf(src, folder):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")

    def fake_run(cmd, stdout, stderr):
        calls.append(cmd)
        out = cmd[cmd.index("-o") + 1]
        if "fail-model" in cmd[cmd.index("-i") + 1]:
            stdout.write("Traceback ...\nValueError: unsupported model\n")
            return subprocess.CompletedProcess(cmd, 1)
        Path(out).mkdir()
        (Path(out) / "genai_config.json").write_text(json.dumps({"model": {"context_length": 64}}))
        (Path(out) / "model.onnx").write_bytes(b"x" * 1000)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(peer_models, "_save_hf_folder", save_hf)
    monkeypatch.setattr(peer_models.subprocess, "run", fake_run)
    return source, calls


def test_the_model_is_built_once_into_its_folder_with_a_record(stubbed):
    source, calls = stubbed
    messages = []
    folder = build_ortgenai(source, log=messages.append)
    assert folder == ortgenai_dir(source) and folder.name == "Tiny-1M.Q4_0-int4" and is_built(folder)
    assert folder.parent.name == "ortgenai" and folder.parent.parent.name == "peers"
    [cmd] = calls
    assert cmd[1:3] == ["-m", "onnxruntime_genai.models.builder"]
    assert cmd[cmd.index("-p") + 1] == "int4" and cmd[cmd.index("-e") + 1] == "cpu"
    assert cmd[cmd.index("--extra_options") + 1:] == ["block_size=32", "accuracy_level=4"]
    record = json.loads((folder / RECORD).read_text())
    assert record["source"] == str(source) and record["options"]["block_size"] == 32 and record["bytes"] > 1000
    assert "building Tiny-1M.Q4_0-int4" in messages[0] and "MiB, built in" in messages[-1]
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # no temporary folder left
    assert build_ortgenai(source, log=messages.append) == folder and len(calls) == 1  # already built
    assert "already built" in messages[-1]
    build_ortgenai(source, force=True, log=messages.append)
    assert len(calls) == 2 and is_built(folder)
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]


def test_a_failing_build_leaves_nothing_behind(stubbed, tmp_path):
    _, calls = stubbed
    bad = tmp_path / "fail-model.gguf"
    bad.write_bytes(b"GGUF")
    with pytest.raises(SpecrtError, match=r"model builder failed \(exit 1\)(.|\n)*ValueError: unsupported model"):
        build_ortgenai(bad, log=lambda m: None)
    assert not ortgenai_dir(bad).exists()
    assert list(ortgenai_dir(bad).parent.iterdir()) == []  # the temporary folder is gone too


def test_a_missing_source_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRT_HOME", str(tmp_path))
    with pytest.raises(SpecrtError, match="which does not exist: put it back or export the bundle again"):
        build_ortgenai(tmp_path / "gone.gguf")
