"""A minimal bundle on disk for the schema tests: a valid manifest.json and the files whose digests it
records (no real graph: these tests never run one)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from specrt.schema.digests import sha256_file

CONFIG = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_layers": 2,
          "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
          "rope_inv_freq": [1.0 / 10000 ** (i / 8) for i in range(8)], "max_position_embeddings": 256,
          "eos_token_ids": [2]}
GRAPH = {"role": "target", "file": "target/decoder.onnx", "config": CONFIG, "inputs": ["input_ids"],
         "outputs": ["logits"], "opset": 24, "source": "tiny"}
MANIFEST = {"schema_version": 1, "versions": {"specrt": "0"}, "graphs": {"target": GRAPH},
            "tokenizer": {"file": "tokenizer/tokenizer.json", "chat_template": "", "bos_token": None,
                          "eos_token": "</s>"},
            "artifacts": {}, "drafters": {}, "runtime_defaults": {}}


def manifest_dict() -> dict:
    return copy.deepcopy(MANIFEST)


def write_bundle(folder: Path) -> Path:
    """`folder` with target/decoder.onnx(.data) of distinct bytes and a manifest recording their digests."""
    d = manifest_dict()
    (folder / "target").mkdir(parents=True)
    names = ("decoder.onnx", "decoder.onnx.data")
    for name, size in zip(names, (300, 5000), strict=True):
        (folder / "target" / name).write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    d["graphs"]["target"]["sha256"] = {n: sha256_file(folder / "target" / n) for n in names}
    (folder / "manifest.json").write_text(json.dumps(d))
    return folder
