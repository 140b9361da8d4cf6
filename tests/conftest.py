"""Session fixtures: the real default model (loaded once) and a bundle exported from it by this code."""

from __future__ import annotations

import os

import pytest

from tests import kind_coverage


def pytest_collectreport(report):
    kind_coverage.collected_file(report)


def pytest_itemcollected(item):
    kind_coverage.collected_item(item)


@pytest.fixture(scope="session")
def default_gguf():
    from specrt.export.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def real_model(default_gguf):
    """SmolLM2-135M-Instruct, dequantized, in our module (and transformers' model for parity)."""
    from specrt.export.loading import load_model

    return load_model(default_gguf)


@pytest.fixture(scope="session")
def real_bundle(real_model, tmp_path_factory):
    """A bundle exported by this very code from the real model (target + 4-layer truncated draft)."""
    from specrt.export.bundle import ExportOptions, export_bundle

    out = tmp_path_factory.mktemp("bundle") / "smollm2"
    export_bundle(real_model, out, ExportOptions(draft_layers=4, progress=False))
    return out


@pytest.fixture(scope="session")
def real_generator(real_bundle):
    from specrt.runtime.generate import Generator

    return Generator(real_bundle, drafter="plain", max_seq_len=1024, threads=os.cpu_count() or 2)


@pytest.fixture(scope="session")
def tokenizer_dir(real_bundle):
    return real_bundle / "tokenizer"


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory, tokenizer_dir):
    """A 2-layer random Llama with the real tokenizer (vocab 49152), exported with a 1-layer draft."""
    from specrt.export.bundle import ExportOptions, export_bundle
    from tests.helpers import save_tiny_folder

    folder = save_tiny_folder(tmp_path_factory.mktemp("tiny") / "llama", "llama", tokenizer_dir,
                              vocab_size=49152, max_position_embeddings=64)
    out = tmp_path_factory.mktemp("tinyb") / "bundle"
    export_bundle(folder, out, ExportOptions(draft_layers=1, progress=False))
    return out


@pytest.fixture(scope="session")
def random_drafters_bundle(tmp_path_factory, tokenizer_dir):
    """A tiny random Llama exported with random Medusa, EAGLE, EAGLE-3 and MTP drafters (and a 1-layer
    draft): (bundle, loaded target, [(kind, checkpoint folder)])."""
    from tests.helpers import random_drafter_bundle, random_drafters

    return random_drafter_bundle(tmp_path_factory.mktemp("random_drafters"), tokenizer_dir, random_drafters(), 1)


@pytest.fixture(scope="session")
def trained_drafters(real_model, tmp_path_factory):
    """Every learned drafter kind trained briefly (seconds each) on the real target's answers to a few
    prompts: ([(kind, checkpoint folder)], the prompt rows trained on, each kind's training metrics)."""
    from specrt import kinds
    from specrt.export.drafters.base import default_taps
    from specrt.export.training.corpus import load_prompts
    from specrt.export.training.datagen import build_data
    from specrt.export.training.loop import TrainSettings, train
    from specrt.kinds import learned_kinds
    from specrt.tools.validate import PROMPT

    tmp = tmp_path_factory.mktemp("trained")
    rows = [r for r in load_prompts("train")][:9:3] + [{"id": "validate", "split": "train", "prompt": PROMPT}]
    rows += load_prompts("heldout")[:1]
    data = build_data(real_model, rows, 40, tuple(default_taps(real_model.module.cfg.num_layers)), None, False)
    metrics, folders = {}, []
    for kind in learned_kinds():
        training = kinds.kind(kind).training
        settings = TrainSettings(kind=kind, epochs=training.test_epochs, batch_seqs=2, evals=1, draft_vocab=2048,
                                 options=dict(training.test_options))
        metrics[kind] = train(real_model.module, settings, tmp / kind, data, progress=False)
        folders.append((kind, tmp / kind))
    return folders, rows[:-1], metrics


def _trained_bundle(real_model, trained_drafters, tmp_path_factory, quantize):
    from specrt.export.bundle import ExportOptions, export_bundle

    out = tmp_path_factory.mktemp("trainedb") / (quantize or "fp32")
    # graph parity is tested per kind on tiny models (tests/export/test_drafters.py); skipped here for time
    export_bundle(real_model, out, ExportOptions(progress=False, check_parity=False, quantize=quantize,
                                                 drafters=tuple(trained_drafters[0])))
    return out


@pytest.fixture(scope="session")
def trained_bundle(real_model, trained_drafters, tmp_path_factory):
    """The real target (fp32) with every trained drafter kind."""
    return _trained_bundle(real_model, trained_drafters, tmp_path_factory, None)


@pytest.fixture(scope="session")
def trained_int4_bundle(real_model, trained_drafters, tmp_path_factory):
    """The default configuration: the real target quantized to int4, with every trained drafter kind."""
    return _trained_bundle(real_model, trained_drafters, tmp_path_factory, "int4")
