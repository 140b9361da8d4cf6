"""Code paths chosen from the machine, and how each is forced: the registry of specrt/branches.py (training
precision, torch's int8 engine, the native backend's kernel) with the runtime's execution mode added, whose
values runtime/exec_modes.py defines. docs/exactness.md lists every branch with the test that runs each
value.
"""

from __future__ import annotations

from specrt.branches import AUTO, BRANCHES, Branch, Choice, pick, record, register
from specrt.runtime.exec_modes import MODES

register(Branch("exec_mode", "SPECRT_EXEC_MODE", tuple(MODES),
                "the cheapest mode measured batch-invariant on this machine (runtime/exactness.py)"))

__all__ = ["AUTO", "BRANCHES", "Branch", "Choice", "pick", "record"]
