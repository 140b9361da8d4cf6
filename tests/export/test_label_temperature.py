"""Sharpened soft labels (`specrt train --label-temperature`): p^(1/T) renormalised to each row's mass keeps
the order of the target's candidates, moves mass toward its argmax as T falls (one-hot in the limit), leaves
p alone at 1, and reaches the loss a training step takes."""

from __future__ import annotations

import pytest
import torch

from specrt.errors import SpecrtError
from specrt.export.loading import module_from_hf
from specrt.export.training.datagen import DistillData
from specrt.export.training.loop import TrainSettings, weigh_steps
from specrt.export.training.objectives import Batch, sharpen
from tests.export.test_step_weights import VOCAB, _data, _loss
from tests.helpers import tiny_hf_model


@pytest.fixture(scope="module")
def target():
    return module_from_hf(tiny_hf_model("llama", seed=3))


def test_sharpening_keeps_the_order_and_mass_and_moves_mass_to_the_argmax():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.2, 0.0, 0.6, 0.1], [0.25, 0.25, 0.25, 0.25]])
    assert torch.equal(sharpen(p, 1.0), p)
    half = sharpen(p, 0.5)
    assert torch.allclose(half.sum(-1), p.sum(-1))  # row 1 holds 0.9: the top-k list's own mass
    assert torch.allclose(half[0], torch.tensor([0.25, 0.09, 0.0225, 0.0025]) / 0.365)  # p^2, renormalised
    assert torch.equal(half.argsort(-1, descending=True)[:2], p.argsort(-1, descending=True)[:2])
    assert half[1, 1] == 0  # a candidate the target gave nothing stays at nothing
    assert torch.allclose(half[2], p[2])  # a tie stays a tie
    steps = [float(sharpen(p, t)[0, 0]) for t in (1.0, 0.7, 0.5, 0.2)]
    assert steps == sorted(steps) and steps[0] == 0.5
    assert torch.allclose(sharpen(p, 0.01)[:2], torch.tensor([[1.0, 0, 0, 0], [0, 0, 0.9, 0]]), atol=1e-6)
    tiny = torch.tensor([[1e-20, 1e-25, 0.0]])  # powers that underflow in linear space
    assert torch.allclose(sharpen(tiny, 0.1), torch.tensor([[1e-20, 0.0, 0.0]]))


def test_the_batch_sharpens_before_the_label_vocabulary_drops_what_it_lacks(target):
    data = _data(target)
    kept = torch.arange(VOCAB)
    plain, sharp = Batch(data, [0, 1], kept), Batch(data, [0, 1], kept, 0.5)
    assert torch.equal(plain.label_ids, sharp.label_ids) and not torch.allclose(plain.label_p, sharp.label_p)
    assert torch.allclose(sharp.label_p, sharpen(plain.label_p, 0.5))
    dropped = torch.full((VOCAB,), -1, dtype=torch.long)
    dropped[: VOCAB // 2] = torch.arange(VOCAB // 2)  # a label vocabulary of the first half of the ids
    half = Batch(data, [0, 1], dropped, 0.5)
    outside = plain.label_ids >= VOCAB // 2  # the target's candidates the label vocabulary lacks
    assert torch.all(half.label_p[outside] == 0)
    assert torch.allclose(half.label_p[~outside], sharp.label_p[~outside])  # the kept ones as sharpened over all


def test_the_temperature_reaches_the_loss_and_a_bad_one_is_refused(target):
    data = _data(target)
    assert _loss_at(target, data, 1.0) == pytest.approx(_loss(target, data), rel=1e-7)
    # a step at T = 0.5 takes the loss of the same data distilled with labels sharpened so, not the plain one
    sharpened = DistillData(data.tokens, data.offsets, data.prompt_lens, data.hidden, data.aux, data.top_ids,
                            sharpen(data.top_p.float(), 0.5).to(data.top_p.dtype), data.taps, data.heldout)
    assert _loss_at(target, data, 0.5) == pytest.approx(_loss_at(target, sharpened, 1.0), rel=1e-6)
    assert _loss_at(target, data, 0.5) != _loss_at(target, data, 1.0)
    for bad in (0.0, 1.5):
        with pytest.raises(SpecrtError, match=f"--label-temperature {bad}: choose a temperature in"):
            weigh_steps(None, TrainSettings(kind="eagle", label_temperature=bad))


def _loss_at(target, data, temperature: float) -> float:
    from specrt.export import drafters
    from specrt.kinds import resolve

    torch.manual_seed(0)
    module = drafters.build(drafters.make_config("eagle"), target)
    objective = resolve(drafters.kind_spec("eagle").training.objective)(module, data, torch.arange(VOCAB), 3)
    with torch.no_grad():
        return float(objective(Batch(data, [0, 1], torch.arange(VOCAB), temperature))[0])
