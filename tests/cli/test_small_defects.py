"""Small CLI defects, each pinned: the default bundle's refusal says where specrt looked and the
SPECRT_HOME fix; `--draft-layers` names its range including 0 and its default fits a small target;
`train --max-prompts` is recorded; `--drafter KIND` on a bundle without it lists what the bundle runs
and how to add KIND. Tiny random models with a word-level tokenizer: no real model is exported."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from specrt.cli import cli
from specrt.errors import SpecrtError
from tests.helpers import save_tiny_folder

VOCAB = 128


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), standalone_mode=False)


# ── SPECRT_HOME: where the default bundle is looked for ──────────────────────────────────────────

def test_no_default_bundle_names_where_specrt_looked_and_the_specrt_home_fix(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECRT_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    result = invoke("build")
    message = str(result.exception)
    assert isinstance(result.exception, SpecrtError) and "\n" not in message
    assert str(tmp_path / "artifacts" / "bundles" / "smollm2-135m-instruct") in message
    assert "SPECRT_HOME is not set" in message and "SPECRT_HOME=/path/to/checkout/artifacts" in message
    monkeypatch.setenv("SPECRT_HOME", str(tmp_path / "home"))
    assert f"SPECRT_HOME is {tmp_path / 'home'}" in str(invoke("build").exception)


def test_the_help_says_where_specrt_home_defaults_to():
    from specrt.paths import home

    text = " ".join(invoke("--help").output.split())
    assert "$SPECRT_HOME, default ./artifacts of the current directory" in text
    assert "SPECRT_HOME=/path/to/checkout/artifacts" in text
    with pytest.MonkeyPatch.context() as m:
        m.delenv("SPECRT_HOME", raising=False)
        assert home() == Path("artifacts").resolve()  # what the help says


# ── export --draft-layers ─────────────────────────────────────────────────────────────────────────

def test_draft_layers_default_fits_the_target_and_an_explicit_bad_value_names_the_range_with_0():
    from specrt.export.bundle import draft_layer_count

    assert [draft_layer_count("default", n) for n in (1, 2, 5, 30)] == [0, 1, 4, 4]
    assert draft_layer_count(0, 2) == 0 and draft_layer_count(None, 2) == 0 and draft_layer_count(1, 2) == 1
    with pytest.raises(SpecrtError, match=r"--draft-layers 4: the target has 2 layers, so choose 0 to 1 "
                                          r"\(N: a draft of its first N layers; 0: no layer-truncated draft\)"):
        draft_layer_count(4, 2)
    with pytest.raises(SpecrtError, match=r"the target has 1 layer, so choose only 0"):
        draft_layer_count(1, 1)


def test_export_passes_the_default_unless_draft_layers_is_given(monkeypatch, tmp_path):
    import specrt.export.bundle as bundle

    seen = []

    def capture(model, out, opts):
        seen.append(opts.draft_layers)
        raise SpecrtError("stop here")

    monkeypatch.setattr(bundle, "export_bundle", capture)
    (tmp_path / "config.json").write_text("{}")  # a model folder to the path check; never loaded here
    for args in ([], ["--draft-layers", "0"], ["--draft-layers", "3"]):
        invoke("export", "--model", str(tmp_path), "-o", str(tmp_path / "b"), *args)
    assert seen == ["default", 0, 3]


def save_word_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    """A 2-layer random Llama as export_bundle takes it (module, word tokenizer)."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from specrt.export.loading import LoadedModel, module_from_hf

    tmp = tmp_path_factory.mktemp("two_layers")
    folder = save_tiny_folder(tmp / "llama", "llama", None)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(save_word_tokenizer(tmp / "tokenizer"))
    return LoadedModel(module=module_from_hf(hf), tokenizer=tokenizer, source=str(folder), hf_config=hf.config)


@pytest.fixture(scope="module")
def default_export(two_layers, tmp_path_factory):
    """The 2-layer model exported with the default options: a bundle with a draft model, no learned drafter."""
    from specrt.export.bundle import ExportOptions, export_bundle

    out = tmp_path_factory.mktemp("default_export") / "bundle"
    return out, export_bundle(two_layers, out, ExportOptions(progress=False, check_parity=False))


def test_the_default_draft_of_a_2_layer_target_is_its_first_layer(default_export):
    _, manifest = default_export
    assert manifest.graphs["draft"].config.num_layers == 1


def test_an_explicit_draft_layers_beyond_the_target_is_refused_before_anything_is_written(two_layers, tmp_path):
    from specrt.export.bundle import ExportOptions, export_bundle

    with pytest.raises(SpecrtError, match=r"--draft-layers 4: the target has 2 layers, so choose 0 to 1"):
        export_bundle(two_layers, tmp_path / "b", ExportOptions(draft_layers=4, progress=False))
    assert not list(tmp_path.iterdir())


# ── train --max-prompts ───────────────────────────────────────────────────────────────────────────

def test_train_records_max_prompts_in_its_settings(monkeypatch, tmp_path):
    """metrics.json's "settings" is `asdict(TrainSettings)`: the value used must be in it."""
    import specrt.export.loading as loading
    import specrt.export.training.loop as loop

    runs = []

    def fake_train(loaded, settings, out, cache_dir, rows):
        runs.append((settings, rows))
        return {"final": {"seconds": 0.0, "top1_per_step": [], "tau_est": 1.0}, "steps_done": 0,
                "cut_by_max_minutes": False}

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: SimpleNamespace(module=None))
    monkeypatch.setattr(loop, "train_from_prompts", fake_train)
    result = invoke("train", "medusa", "--target", str(tmp_path), "-o", str(tmp_path / "out"), "--max-prompts", "12")
    assert result.exception is None, result.output
    settings, rows = runs[0]
    assert asdict(settings)["max_prompts"] == 12 and len(rows) == 12


def test_train_refuses_max_prompts_with_a_store(tmp_path):
    import click

    result = invoke("train", "medusa", "--store", str(tmp_path), "--max-prompts", "12")
    assert isinstance(result.exception, click.UsageError) and "--store" in str(result.exception)


# ── --drafter KIND on a bundle without it ─────────────────────────────────────────────────────────

@pytest.mark.parametrize("drafter", ["eagle", "eagle2"])
def test_a_missing_learned_drafter_lists_what_the_bundle_runs_and_how_to_add_it(default_export, drafter):
    from specrt.runtime.generate import Generator

    bundle, _ = default_export
    with pytest.raises(SpecrtError) as refused:
        Generator(bundle, drafter=drafter, max_seq_len=64)
    message = str(refused.value)
    assert "\n" not in message and f"has no eagle drafter for --drafter {drafter}" in message
    assert "it runs plain, ngram, suffix, auto, draft." in message
    assert "Add eagle with `specrt train eagle` then `specrt export --drafter eagle`" in message


def test_a_missing_draft_model_says_how_to_export_one():
    from specrt.kinds import not_in_bundle

    manifest = SimpleNamespace(graphs={"target": None}, drafters={"medusa": {}})
    message = not_in_bundle("draft", manifest, "B")
    assert "it runs plain, ngram, suffix, auto, medusa." in message
    assert "`specrt export --draft-layers N`" in message and "`specrt train draft` then" in message
