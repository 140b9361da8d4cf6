"""Code paths chosen from the machine, and how each is forced (the registry; runtime/branches.py adds the
runtime's execution mode to it).

Some choices follow the CPU (bf16 autocast in training where the CPU computes bf16 natively, torch's
int8 engine in distillation, the execution mode of the target). Each one is a `Branch`: `auto` keeps
the machine's choice; a value given by the caller (a command-line option) wins, else the branch's
environment variable, else the machine. What ran, and whether it was forced, goes into the output
that the branch produces (`metrics.json`, the distill summary, `--json`'s `exactness`), so a result
names its branch. docs/exactness.md lists every branch with the test that runs each value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from specrt.errors import SpecrtError

AUTO = "auto"


@dataclass(frozen=True)
class Branch:
    name: str
    env: str  # environment variable that forces it where the caller asks for auto
    values: tuple[str, ...]  # what can be forced
    default: str  # what picks it under auto


@dataclass(frozen=True)
class Choice:
    value: str  # the value requested or forced; "auto" when the machine decides
    forced_by: str  # "" (the machine), "option" or the environment variable's name

    @property
    def forced(self) -> bool:
        return bool(self.forced_by)


BRANCHES: dict[str, Branch] = {b.name: b for b in (
    Branch("train_precision", "SPECRT_TRAIN_PRECISION", ("bf16", "fp32"),
           "bf16 autocast where the CPU reports avx512_bf16, amx_bf16 or Arm bf16; else fp32"),
    Branch("quant_engine", "SPECRT_QUANT_ENGINE", ("x86", "fbgemm", "onednn", "qnnpack"),
           "torch.backends.quantized.engine as torch sets it for this CPU (x86 on x86-64)"),
    Branch("native_kernel", "SPECRT_NATIVE_KERNEL", ("scalar", "avx2", "avx512vnni", "amx"),
           "the fastest kernel of the native backend this CPU executes (engines/native/library.py)"),
    Branch("drafter_layers", "SPECRT_DRAFTER_LAYERS", ("ort", "native"),
           "native where the target runs on the native backend and the graph is an int4 EAGLE-1/2, EAGLE-3 or "
           "MTP layer, int4 Medusa heads or an int4 draft model; else ort (runtime/drafters/features.py)"),
)}


def register(branch: Branch) -> None:
    """Add a branch whose values a higher layer defines (runtime/branches.py: the execution mode)."""
    BRANCHES[branch.name] = branch


def pick(name: str, requested: str = AUTO) -> Choice:
    """The value of branch `name`: `requested` unless it is auto, else its environment variable's value
    unless unset, empty or auto, else auto (the machine decides). A value not in the branch is refused."""
    branch = BRANCHES[name]
    if requested != AUTO:
        return Choice(_valid(branch, requested, f"{name} {requested!r}"), "option")
    env = os.environ.get(branch.env, "").strip()
    if env and env != AUTO:
        return Choice(_valid(branch, env, f"{branch.env}={env!r}"), branch.env)
    return Choice(AUTO, "")


def _valid(branch: Branch, value: str, what: str) -> str:
    if value not in branch.values:
        raise SpecrtError(f"{what}: choose auto or one of {', '.join(branch.values)} "
                          f"(unset {branch.env} to let the machine choose)")
    return value


def record(choice: Choice, value: str, why: str = "") -> dict:
    """What the output of a branch says about it: the value that ran and who chose it."""
    return {"value": value, "forced": choice.forced, "chosen_by": choice.forced_by or f"auto: {why}".rstrip(": ")}
