"""`specrt build` (ONNX Runtime): the optimized graphs are what the runtime then loads, losslessly."""

from __future__ import annotations

import os
import shutil

from specrt.engines.ort_cpu.build import build_ort
from specrt.runtime.generate import Generator
from specrt.schema.manifest import Manifest


def link_copy(src: str, dst: str) -> None:
    """Copy small JSON files (the manifest is rewritten), symlink the large graph files."""
    if src.endswith(".json"):
        shutil.copy2(src, dst)
    else:
        os.symlink(src, dst)


def test_built_graphs_are_used_and_give_the_same_tokens(real_bundle, real_generator, tmp_path):
    bundle = tmp_path / "b"
    shutil.copytree(real_bundle, bundle, copy_function=link_copy)
    manifest = Manifest.load(bundle)
    manifest.artifacts["onnxruntime"] = build_ort(bundle, manifest)
    manifest.save(bundle)
    assert Manifest.load(bundle).onnx_path(bundle, "target").name == "decoder.ort-opt.onnx"

    gen = Generator(bundle, max_seq_len=512, threads=real_generator.threads)
    assert gen.target.path.name == "decoder.ort-opt.onnx"
    ids = gen.tokenizer.encode_prompt("Repeat exactly: red, green, blue, red, green, blue.")
    want = real_generator.use("plain").generate_ids(ids, 32).token_ids
    for drafter in ("plain", "ngram", "draft"):
        assert gen.use(drafter).generate_ids(ids, 32).token_ids == want, drafter
