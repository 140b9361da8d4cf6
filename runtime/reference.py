"""What a generator's output is exact to: plain decoding of one target graph, on one backend, in one
execution mode.

Greedy speculative output equals plain greedy decoding *of the same graph run the same way*. Two
backends of one bundle (`ort` and `ort-fused`: the same int4 weights, attention computed by other
kernels) or two execution modes (`direct`, `pad2`) are two references: each is exact to its own plain
decoding, and their plain outputs may differ where the model's top two logits are within rounding.
`specrt generate --json`, `/v1/models` and `specrt bench` name the reference with this record.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Reference:
    backend: str  # engines/registry.py name
    graph: str  # the target graph file it runs, relative to the bundle
    precision: str  # fp32, or the weight quantization (int4, int8)
    exec_mode: str  # runtime/exec_modes.py name
    target_digest: str  # of the target's file digests (manifest): two bundles' references are told apart

    @classmethod
    def of(cls, gen) -> Reference:
        """The reference of a Generator: its backend, the graph its exactness was judged on, its mode."""
        quant = gen.manifest.artifacts.get("quantization") or {}
        return cls(gen.backend, str(gen.exactness.record["graph"]), quant.get("scheme", "fp32"),
                   gen.exactness.mode.name, _digest(gen.manifest.target.sha256))

    def describe(self, greedy: bool = True) -> str:
        """One line, e.g. "plain greedy decoding of target/decoder.onnx (int4) on backend ort, exec mode pad2"."""
        what = "plain greedy decoding" if greedy else "the distribution of plain sampling"
        return f"{what} of {self.graph} ({self.precision}) on backend {self.backend}, exec mode {self.exec_mode}"

    def to_dict(self, greedy: bool = True) -> dict:
        """The fields, plus `decoding` ("plain greedy" / "plain sampling") and `text` (describe)."""
        return {"decoding": "plain greedy" if greedy else "plain sampling", **asdict(self),
                "text": self.describe(greedy)}


def same_reference(a: dict | None, b: dict | None) -> bool | None:
    """Are two `to_dict` records the same reference (its text aside)? None where either is unknown."""
    if a is None or b is None:
        return None
    return {k: v for k, v in a.items() if k != "text"} == {k: v for k, v in b.items() if k != "text"}


def _digest(files: dict) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
