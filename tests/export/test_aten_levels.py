"""ATen's SIMD kernel level is chosen by torch from the CPU (AVX-512 on one machine, AVX2 on another), and it
changes the order of every reduction training runs. ATEN_CPU_CAPABILITY forces it at process start, so each
level this CPU can execute runs here, in its own process: training works at every level, metrics.json
records the level, and the losses agree with each other within fp32 summation-order rounding."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# ATen's x86 levels, lowest first; a level above the CPU's own cannot execute on it at all
X86_LEVELS = ("default", "avx2", "avx512")
# fp32 reductions in another order: each of the ~10 ops on the loss path (K ≤ 128 terms here) moves by at
# most K·2^-24 of Σ|terms|, about 1e-5 of the loss; 1e-4 leaves an order of magnitude
REORDER_RTOL = 1e-4
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys, pathlib, torch
from specrt.export.loading import module_from_hf
from specrt.export.training.datagen import DistillData, generate
from specrt.export.training.loop import TrainSettings, train
from tests.helpers import tiny_hf_model
target = module_from_hf(tiny_hf_model("llama", seed=3))
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (6, 9, 7)]
seqs = generate(target, prompts, 16, (0, 1), batch_size=3, progress=False)
data = DistillData.from_sequences(seqs, [len(p) for p in prompts], [False, False, True], (0, 1))
settings = TrainSettings(kind="medusa", epochs=4, batch_seqs=2, evals=4, lr=0.05, draft_vocab=128,
                         options={"num_heads": 2}, precision="fp32")
metrics = train(target, settings, pathlib.Path(sys.argv[1]), data, progress=False)
print(json.dumps({"losses": [p["loss"] for p in metrics["curve"]], "aten": metrics["branches"]["aten_dispatch"]}))
"""


def levels_here() -> list[str]:
    own = torch.backends.cpu.get_cpu_capability().lower()
    if own not in X86_LEVELS:
        pytest.skip(f"ATen level {own!r} is not an x86 level; this test knows {X86_LEVELS}")
    return list(X86_LEVELS[: X86_LEVELS.index(own) + 1])


def test_training_runs_at_every_aten_level_this_cpu_executes(tmp_path):
    runs = {}
    for level in levels_here():
        env = {**os.environ, "ATEN_CPU_CAPABILITY": level, "PYTHONPATH": str(ROOT)}
        out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / level)], env=env, capture_output=True,
                             text=True, timeout=300, check=False, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-2000:]
        runs[level] = json.loads(out.stdout.strip().splitlines()[-1])
        assert runs[level]["aten"] == {"value": level.upper(), "forced": True, "chosen_by": "ATEN_CPU_CAPABILITY"}
        losses = runs[level]["losses"]
        assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], (level, losses)
    assert len(runs) >= 2, f"only {list(runs)} ran: every x86 CPU here has at least default and avx2"
    first = runs["default"]["losses"]
    for level, run in runs.items():
        assert run["losses"] == pytest.approx(first, rel=REORDER_RTOL), (level, run["losses"], first)
