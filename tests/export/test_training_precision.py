"""Training precision is a branch the CPU chooses (bf16 autocast where bf16 is native, else fp32):
both values run here, whatever the CPU, on a tiny target in seconds, and metrics.json names the one
that ran and who chose it (export/training/precision.py, runtime/branches.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specrt.errors import SpecrtError
from specrt.export.loading import module_from_hf
from specrt.export.training.datagen import DistillData, generate
from specrt.export.training.loop import TrainSettings, train
from specrt.export.training.precision import METRICS_NAME, autocast, native_bf16, train_precision
from tests.helpers import tiny_hf_model

# bf16 keeps 8 significant bits: rounding an operand moves it by at most 2^-9 of itself, so a bf16
# matmul (both operands rounded, fp32 accumulation) moves each output by at most 2·2^-9 = 2^-8 of
# Σ|w·x|. Medusa's loss path has 2 matmuls (the head's residual layer, the LM head), and a soft
# cross-entropy moves by at most 2·max|Δlogit| (its gradient, softmax − p, has ℓ1 norm ≤ 2). At a
# random initialisation the logits and the loss are both of order log(vocab), so relative to the loss:
BF16_LOSS_RTOL = 2 * 2 * 2**-8


@pytest.fixture(scope="module")
def tiny_data():
    """A tiny random target and its greedy answers to 3 prompts (2 train, 1 held out)."""
    target = module_from_hf(tiny_hf_model("llama", seed=3))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (6, 9, 7)]
    seqs = generate(target, prompts, 16, (0, 1), batch_size=3, progress=False)
    return target, DistillData.from_sequences(seqs, [len(p) for p in prompts], [False, False, True], (0, 1))


def _train(tiny_data, tmp_path, precision: str, steps: int = 8) -> dict:
    target, data = tiny_data
    # both training sequences in every batch: each step's loss is the same batch's, so it must fall
    settings = TrainSettings(kind="medusa", epochs=steps, batch_seqs=2, evals=steps, lr=0.05, draft_vocab=128,
                             options={"num_heads": 2}, precision=precision)
    return train(target, settings, tmp_path / precision, data, progress=False)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_each_training_precision_runs_here_and_is_recorded(tiny_data, tmp_path, precision):
    metrics = _train(tiny_data, tmp_path, precision)
    losses = [p["loss"] for p in metrics["curve"]]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses), losses
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses  # the same batch, every step: it learns
    saved = json.loads((tmp_path / precision / "metrics.json").read_text())
    assert saved["precision"] == METRICS_NAME[precision]
    assert saved["branches"]["train_precision"] == {"value": precision, "forced": True, "chosen_by": "option"}
    assert saved["branches"]["aten_dispatch"]["value"] == torch.backends.cpu.get_cpu_capability()


def test_bf16_loss_is_the_fp32_loss_within_bf16_rounding(tiny_data, tmp_path):
    """The same initial weights (same seed) on the same first batch: the step-1 losses differ only by
    bf16 rounding (BF16_LOSS_RTOL, derived above); and the bf16 branch really computes in bf16."""
    bf16 = _train(tiny_data, tmp_path, "bf16", steps=1)["curve"][0]["loss"]
    fp32 = _train(tiny_data, tmp_path, "fp32", steps=1)["curve"][0]["loss"]
    assert abs(bf16 - fp32) <= BF16_LOSS_RTOL * fp32, (bf16, fp32, abs(bf16 - fp32) / fp32)
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    with autocast("bf16"):
        assert torch.nn.functional.linear(x, w).dtype == torch.bfloat16
    with autocast("fp32"):
        assert torch.nn.functional.linear(x, w).dtype == torch.float32


def test_auto_follows_the_cpu_and_the_variable_forces_it(monkeypatch):
    monkeypatch.delenv("SPECRT_TRAIN_PRECISION", raising=False)
    value, record = train_precision("auto")
    assert value == ("bf16" if native_bf16() else "fp32") and record["forced"] is False
    assert record["chosen_by"].startswith("auto: ")
    for forced in ("bf16", "fp32"):
        monkeypatch.setenv("SPECRT_TRAIN_PRECISION", forced)
        assert train_precision("auto") == (forced, {"value": forced, "forced": True,
                                                    "chosen_by": "SPECRT_TRAIN_PRECISION"})
        other = "fp32" if forced == "bf16" else "bf16"
        assert train_precision(other)[0] == other  # the option wins over the variable
    monkeypatch.setenv("SPECRT_TRAIN_PRECISION", "fp16")
    with pytest.raises(SpecrtError, match="SPECRT_TRAIN_PRECISION='fp16'.*bf16, fp32"):
        train_precision("auto")


def test_train_cli_passes_precision(monkeypatch, tmp_path):
    """`specrt train --precision fp32` reaches the settings (the model load is faked)."""
    from click.testing import CliRunner

    import specrt.export.loading as loading
    import specrt.export.training.loop as loop
    from specrt.cli import cli

    seen = {}

    def fake_train(loaded, settings, out, cache_dir, rows):
        seen["precision"] = settings.precision
        return {"final": {"seconds": 0, "top1_per_step": [], "tau_est": 1.0}, "steps_done": 0,
                "cut_by_max_minutes": False}

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: None)
    monkeypatch.setattr(loop, "train_from_prompts", fake_train)
    out = CliRunner().invoke(cli, ["train", "medusa", "--precision", "fp32", "--target", str(tmp_path),
                                   "-o", str(tmp_path / "o")])
    assert out.exit_code == 0, out.output
    assert seen == {"precision": "fp32"}
