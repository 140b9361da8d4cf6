"""Training that survives restarts: a run stopped part-way and resumed ends bitwise where an unbroken run
ends; the saved run refuses other settings; a warm start copies every weight but the draft vocabulary."""

from __future__ import annotations

import json

import pytest
import torch

from specrt.cli.train_cmd import summary
from specrt.errors import SpecrtError
from specrt.export import drafters
from specrt.export.drafters.base import default_taps
from specrt.export.training import checkpoint, loop
from specrt.export.training.corpus import load_prompts
from specrt.export.training.datagen import build_data
from specrt.export.training.loop import TrainSettings, train


class Clock:
    """A clock that moves only when told: the schedule, the limit and the saves never see real time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def data(real_model):
    rows = load_prompts("train")[:6] + load_prompts("heldout")[:1]
    return build_data(real_model, rows, 16, tuple(default_taps(real_model.module.cfg.num_layers)), None, False)


def _settings(**kw) -> TrainSettings:
    return TrainSettings(**{"kind": "eagle3", "epochs": 3, "batch_seqs": 2, "evals": 2, "draft_vocab": 512,
                            "max_minutes": 60.0, **kw})


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(folder / drafters.WEIGHTS)


def test_a_stopped_and_resumed_run_ends_where_an_unbroken_one_does(real_model, data, tmp_path, monkeypatch):
    whole = train(real_model.module, _settings(), tmp_path / "whole", data, progress=False, clock=Clock())
    assert whole["steps_done"] == 9 and not whole.get("interrupted")

    calls = {"n": 0}
    real_batch = loop.Batch

    def stopping_batch(*args):  # a stop (Ctrl-C, SIGTERM) while the 4th step's batch is read
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real_batch(*args)

    monkeypatch.setattr(loop, "Batch", stopping_batch)
    out = tmp_path / "parts"
    first = train(real_model.module, _settings(), out, data, progress=False, clock=Clock())
    assert first["interrupted"] and first["steps_done"] == 3
    assert json.loads((out / "metrics.json").read_text())["interrupted"]  # what scripts/train_round.sh reads
    for final in (first["final"], {}):  # the CLI's line, after an evaluation and for a stop before the first
        line = summary("medusa", {**first, "final": final})
        assert line.startswith("medusa: 3 steps") and "(stopped; --resume goes on)" in line, line
        assert ("no held-out evaluation yet" in line) == (not final), line
    assert checkpoint.saved_run(out) is not None and (out / drafters.WEIGHTS).is_file()  # usable as it stands
    monkeypatch.setattr(loop, "Batch", real_batch)
    with pytest.raises(SpecrtError, match="--resume"):  # never silently started over
        train(real_model.module, _settings(), out, data, progress=False, clock=Clock())
    second = train(real_model.module, _settings(resume=True), out, data, progress=False, clock=Clock())
    assert second["steps_done"] == 9 and not second.get("interrupted")
    assert "interrupted" not in json.loads((out / "metrics.json").read_text())
    got, want = _weights(out), _weights(tmp_path / "whole")
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert [p["step"] for p in second["curve"]] == [p["step"] for p in whole["curve"]]
    assert second["curve"][-1]["tokens_seen"] == whole["curve"][-1]["tokens_seen"]


def test_resume_refuses_other_settings_and_a_missing_run(real_model, data, tmp_path):
    out = tmp_path / "d"
    with pytest.raises(SpecrtError, match="holds no saved run"):
        train(real_model.module, _settings(epochs=1, resume=True), out, data, progress=False, clock=Clock())
    train(real_model.module, _settings(epochs=1), out, data, progress=False, clock=Clock())
    with pytest.raises(SpecrtError, match=r"other settings \(lr None → 0.01\)"):
        train(real_model.module, _settings(epochs=1, resume=True, lr=0.01), out, data, progress=False, clock=Clock())
    meta = json.loads((checkpoint.state_dir(out) / checkpoint.META).read_text())
    assert meta["run"]["step"] == 3 and meta["settings"]["kind"] == "eagle3"


def test_checkpoints_are_written_as_the_clock_passes(real_model, data, tmp_path, monkeypatch):
    clock, saves = Clock(), []
    real_save = checkpoint.save_run

    def counting_save(out, module, opt, rng, run, settings):
        saves.append(run.step)
        clock.now += 1  # nothing else moves the clock
        real_save(out, module, opt, rng, run, settings)

    real_batch = loop.Batch

    def ticking_batch(*args):
        clock.now += 40.0  # each step "takes" 40 s of a 1-minute checkpoint period
        return real_batch(*args)

    monkeypatch.setattr(checkpoint, "save_run", counting_save)
    monkeypatch.setattr(loop, "Batch", ticking_batch)
    train(real_model.module, _settings(epochs=1, checkpoint_minutes=1.0), tmp_path / "c", data, progress=False,
          clock=clock)
    assert saves == [2, 3], saves  # after the 2nd step (80 s > 60 s), not the 3rd (40 s after), and at the end


def test_warm_start_copies_all_but_the_vocabulary(real_model, data, tmp_path):
    base = tmp_path / "base"
    train(real_model.module, _settings(epochs=1), base, data, progress=False, clock=Clock())
    warm = tmp_path / "warm"
    train(real_model.module, _settings(epochs=1, lr=1e-12, draft_vocab=256, init=str(base)), warm, data,
          progress=False, clock=Clock())
    a, b = _weights(base), _weights(warm)
    assert a["d2t"].shape != b["d2t"].shape  # the vocabulary is the new run's
    for k in a:
        if k != "d2t":
            assert torch.allclose(a[k].float(), b[k].float(), atol=1e-6), k  # a 1e-12 rate moves nothing
    module = drafters.build(drafters.make_config("mtp"), real_model.module)
    with pytest.raises(SpecrtError, match="is a eagle3 checkpoint; this run trains mtp"):
        checkpoint.warm_start(module, base)


def test_a_frozen_head_warm_starts_a_run_that_trains_its_own(real_model, data, tmp_path):
    """--init of a head that is the target's rows (not stored) with --set head_from_target=false: every stored
    weight is the init's and the head starts as the target's rows of the new vocabulary, then trains and is
    stored; a head the checkpoint lacks for any other reason is still refused."""
    base = tmp_path / "base"
    train(real_model.module, _settings(epochs=1), base, data, progress=False, clock=Clock())
    assert "lm_head.weight" not in _weights(base)
    own = tmp_path / "own"
    m = train(real_model.module, _settings(epochs=1, lr=1e-12, init=str(base), options={"head_from_target": False}),
              own, data, progress=False, clock=Clock())
    a, b = _weights(base), _weights(own)
    assert all(torch.allclose(a[k].float(), b[k].float(), atol=1e-6) for k in a if k != "d2t")
    vocab = torch.arange(len(b["d2t"])) + b["d2t"]
    assert torch.allclose(b["lm_head.weight"].float(), real_model.module.lm_head.weight[vocab], atol=1e-6)
    assert m["steps_done"] > 0
    trained = tmp_path / "trained"
    train(real_model.module, _settings(epochs=1, lr=1e-2, init=str(base), options={"head_from_target": False}),
          trained, data, progress=False, clock=Clock())
    assert not torch.allclose(_weights(trained)["lm_head.weight"].float(), real_model.module.lm_head.weight[vocab])
    no_head = tmp_path / "no_head"  # says it stores its head, and does not
    no_head.mkdir()
    for f in base.iterdir():
        (no_head / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((base / "config.json").read_text())
    (no_head / "config.json").write_text(json.dumps({**cfg, "head_from_target": False}))
    module = drafters.build(drafters.make_config("eagle3", taps=cfg["taps"], draft_vocab_size=len(vocab),
                                                 head_from_target=False), real_model.module)
    with pytest.raises(SpecrtError, match="does not fit"):
        checkpoint.warm_start(module, no_head)


def test_a_head_of_its_own_rows_warm_starts_by_token_and_keeps_its_rows_trained(real_model, data, tmp_path):
    """--init of a head that trains its own rows, without --set again: the run trains its own rows too, and a
    draft vocabulary of other size or order takes each token's row from the checkpoint where it had one and
    the target's row where it did not (by position, each draft id would get another token's row)."""
    target_head = real_model.module.lm_head.weight.detach()
    own = tmp_path / "own"
    train(real_model.module, _settings(epochs=1, lr=1e-2, draft_vocab=128, options={"head_from_target": False}),
          own, data, progress=False, clock=Clock())
    a = _weights(own)
    ids_a = (torch.arange(len(a["d2t"])) + a["d2t"]).tolist()
    assert not torch.allclose(a["lm_head.weight"].float(), target_head[ids_a])  # trained away from the target's
    wide = tmp_path / "wide"
    m = train(real_model.module, _settings(epochs=0, draft_vocab=512, init=str(own)), wide, data, progress=False,
              clock=Clock())
    assert json.loads((wide / "config.json").read_text())["head_from_target"] is False
    assert m["settings"]["options"] == {}  # inherited, not passed
    b = _weights(wide)
    ids_b = (torch.arange(len(b["d2t"])) + b["d2t"]).tolist()
    assert len(ids_b) == 512 and set(ids_a) < set(ids_b) and ids_b[:128] != ids_a  # wider, in another order
    row_of = {t: i for i, t in enumerate(ids_a)}
    for j, t in enumerate(ids_b):
        want = a["lm_head.weight"][row_of[t]] if t in row_of else target_head[t].to(a["lm_head.weight"].dtype)
        assert torch.equal(b["lm_head.weight"][j], want), (j, t)
    with pytest.raises(SpecrtError, match="does not fit"):  # a frozen head asked for: the stored rows have no place
        train(real_model.module, _settings(epochs=0, draft_vocab=512, init=str(own),
                                           options={"head_from_target": True}),
              tmp_path / "frozen", data, progress=False, clock=Clock())


def test_zero_epochs_saves_the_warm_start_over_a_smaller_vocabulary(real_model, data, tmp_path):
    """`--epochs 0 --init`: no step; every weight is the init's, bitwise, and the draft vocabulary is this data's
    `draft_vocab` most frequent top-1 ids (of the ones the init's wider one held), evaluated on the held-out."""
    base = tmp_path / "base"
    train(real_model.module, _settings(epochs=1), base, data, progress=False, clock=Clock())
    cut = tmp_path / "cut"
    m = train(real_model.module, _settings(epochs=0, draft_vocab=128, init=str(base)), cut, data, progress=False,
              clock=Clock())
    a, b = _weights(base), _weights(cut)
    assert all(torch.equal(a[k], b[k]) for k in a if k != "d2t")
    top1, anywhere = data.top_counts(real_model.module.cfg.vocab_size)
    want = loop.label_vocabulary(top1, anywhere, 128)
    assert torch.equal(torch.arange(128) + b["d2t"], want)
    assert set(want.tolist()) <= set((torch.arange(len(a["d2t"])) + a["d2t"]).tolist())  # 128 of the 512
    assert m["steps_done"] == 0 and len(m["curve"]) == 1 and m["final"]["loss"] is None
    assert m["init_run"]["steps_done"] > 0 and m["init_run"]["label_vocab"] == 512  # the run it was cut from
    assert m["final"]["step"] == 0 and 0.0 <= min(m["final"]["top1_per_step"]) <= 1.0 and m["label_vocab"] == 128
    within = m["final"]["first_step_top_k"]  # the first step's agreement within its 1..4 best candidates
    assert len(within) == 4 and within[0] == m["final"]["top1_per_step"][0] and within == sorted(within)
    head = drafters.load(cut, real_model.module)  # the head rows are the target's, at the new ids
    assert torch.equal(head.lm_head.weight, real_model.module.lm_head.weight[want])
    with pytest.raises(SpecrtError, match="--epochs 0 saves a warm start"):
        train(real_model.module, _settings(epochs=0), tmp_path / "none", data, progress=False, clock=Clock())
