"""The draft-step loss's rows and weights (`--loss-rows`, `--step-decay`): answer-only scoring ignores the
prompt rows' labels and not the answers', a decay weighs each unrolled step's loss, the defaults are the plain
mean over steps, and a kind without draft steps refuses them."""

from __future__ import annotations

import pytest
import torch

from specrt.errors import SpecrtError
from specrt.export import drafters
from specrt.export.loading import module_from_hf
from specrt.export.training.datagen import DistillData
from specrt.export.training.loop import TrainSettings, weigh_steps
from specrt.export.training.objectives import Batch
from specrt.kinds import resolve
from tests.helpers import tiny_hf_model

VOCAB = 128


@pytest.fixture(scope="module")
def target():
    return module_from_hf(tiny_hf_model("llama", seed=3))


def _data(target, prompt_lens=(5, 4), lens=(12, 10), seed=0) -> DistillData:
    g = torch.Generator().manual_seed(seed)
    h = target.cfg.hidden_size
    seqs = []
    for n in lens:
        top = torch.rand(n, 16, generator=g)
        seqs.append((torch.randint(0, VOCAB, (n,), generator=g), torch.randn(n, h, generator=g).half(),
                     torch.zeros(n, 0).half(), torch.randint(0, VOCAB, (n, 16), generator=g),
                     top / top.sum(-1, keepdim=True)))
    return DistillData.from_sequences(seqs, list(prompt_lens), [False] * len(lens), ())


def _loss(target, data, steps=3, **settings) -> float:
    torch.manual_seed(0)
    module = drafters.build(drafters.make_config("eagle"), target)
    objective = resolve(drafters.kind_spec("eagle").training.objective)(module, data, torch.arange(VOCAB), steps)
    weigh_steps(objective, TrainSettings(kind="eagle", **settings))
    with torch.no_grad():
        return float(objective(Batch(data, [0, 1], torch.arange(VOCAB)))[0])


def _relabel(data, rows) -> DistillData:
    """`data` with other labels at `rows` (global row indices)."""
    top_ids = data.top_ids.clone()
    top_ids[rows] = (top_ids[rows] + 7) % VOCAB
    return DistillData(data.tokens, data.offsets, data.prompt_lens, data.hidden, data.aux, top_ids, data.top_p,
                       data.taps, data.heldout)


def test_answer_rows_only_ignore_the_prompts_labels(target):
    data = _data(target)
    # the loss reads sequence row j's label from the draft row after it (j >= 1), an answer row where j >= the
    # prompt's length (Batch.answer): sequence 0 (prompt 5) holds rows 0..11, sequence 1 (prompt 4) rows 12..21
    prompt_rows = [1, 2, 3, 4, 13, 14, 15]
    answer_rows = [5, 9, 16, 21]
    for rows_changed, answer_same, all_same in ((prompt_rows, True, False), (answer_rows, False, False)):
        other = _relabel(data, rows_changed)
        assert (_loss(target, other, loss_rows="answer") == _loss(target, data, loss_rows="answer")) is answer_same
        assert (_loss(target, other) == _loss(target, data)) is all_same


def test_a_step_decay_weighs_each_steps_loss(target):
    data = _data(target)
    per_step = [_loss(target, data, steps=1)]
    for s in (2, 3):  # step s's loss, from the means of 1..s steps
        per_step.append(s * _loss(target, data, steps=s) - sum(per_step))
    assert _loss(target, data, step_decay=1.0) == pytest.approx(sum(per_step) / 3, rel=1e-6)
    want = sum(0.5**i * x for i, x in enumerate(per_step)) / (1 + 0.5 + 0.25)
    assert _loss(target, data, step_decay=0.5) == pytest.approx(want, rel=1e-5)
    assert _loss(target, data, step_decay=0.5) != pytest.approx(_loss(target, data), rel=1e-4)


@pytest.mark.parametrize("settings, says", [
    ({"loss_rows": "answer"}, "weigh the draft steps of eagle, eagle3 and mtp; medusa trains otherwise"),
    ({"step_decay": 0.8}, "medusa trains otherwise"),
])
def test_a_kind_without_draft_steps_refuses_them(target, settings, says):
    module = drafters.build(drafters.make_config("medusa", num_heads=2), target)
    objective = resolve(drafters.kind_spec("medusa").training.objective)(module, _data(target), torch.arange(VOCAB), None)
    with pytest.raises(SpecrtError, match=says):
        weigh_steps(objective, TrainSettings(kind="medusa", **settings))
    weigh_steps(objective, TrainSettings(kind="medusa"))  # the defaults ask nothing of it


@pytest.mark.parametrize("settings, says", [({"loss_rows": "prompt"}, "choose all or answer"),
                                            ({"step_decay": 0.0}, r"choose a weight in \(0, 1\]")])
def test_bad_values_are_refused(target, settings, says):
    with pytest.raises(SpecrtError, match=says):
        weigh_steps(None, TrainSettings(kind="eagle", **settings))
