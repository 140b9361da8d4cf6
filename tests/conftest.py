"""Session fixtures: the real default model (loaded once) and a bundle exported from it by this code."""

from __future__ import annotations

import os

import pytest


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
