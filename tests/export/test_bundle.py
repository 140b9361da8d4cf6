"""Bundles are written atomically, and what a killed export left behind is cleaned up by the next one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specrt.export.bundle import atomic_dir


def dead_pid() -> int:
    """The PID of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def partial(parent, name, pid):
    folder = parent / f".{name}.partial-{pid}"
    (folder / "target").mkdir(parents=True)
    (folder / "target" / "decoder.onnx.data").write_bytes(b"\0" * 1024)
    return folder


def test_stale_partial_folders_of_dead_exports_are_removed(tmp_path):
    stale = partial(tmp_path, "b", dead_pid())
    other_stale = partial(tmp_path, "other", dead_pid())
    live = partial(tmp_path, "other", os.getpid())  # this process is running: never touched
    unrelated = tmp_path / ".b.partial-notapid"
    unrelated.mkdir()
    notes = []
    with atomic_dir(tmp_path / "b", note=notes.append) as tmp:
        (tmp / "manifest.json").write_text("{}")
    assert not stale.exists() and not other_stale.exists()
    assert live.is_dir() and unrelated.is_dir()
    assert (tmp_path / "b" / "manifest.json").is_file()
    assert len(notes) == 2 and all("\n" not in n for n in notes)
    assert any(str(stale) in n and "no longer running" in n for n in notes), notes


def test_nothing_is_said_when_nothing_is_stale(tmp_path):
    notes = []
    with atomic_dir(tmp_path / "b", note=notes.append):
        pass
    assert notes == []


def test_a_failed_export_leaves_nothing_behind(tmp_path):
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "b", note=print) as tmp:
        (tmp / "half").write_text("x")
        raise RuntimeError("export failed")
    assert list(tmp_path.iterdir()) == []
