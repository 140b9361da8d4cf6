"""Partial export folders (`.NAME.partial-PID`, see bundle.atomic_dir) whose process is gone: a SIGKILLed
export cannot clean up after itself, so the next export into the same parent folder does."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

PARTIAL = re.compile(r"^\..+\.partial-(\d+)$")


def pid_alive(pid: int) -> bool:
    """Is process `pid` running (on this machine)? A process of another user counts as alive."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:  # not a PID at all
        return False
    return True


def remove_stale_partials(parent: Path, note: Callable[[str], None]) -> list[Path]:
    """Remove every `.NAME.partial-PID` folder in `parent` whose PID is not a live process (never one of
    a live process, this one included: it may be an export still running); one `note` line per folder."""
    removed = []
    for path in sorted(Path(parent).iterdir()):
        m = PARTIAL.match(path.name)
        if not m or not path.is_dir() or path.is_symlink() or pid_alive(int(m.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        note(f"specrt: removed {path}: a partial export left by process {m.group(1)}, which is no longer running")
        removed.append(path)
    return removed
