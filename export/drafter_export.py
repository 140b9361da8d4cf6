"""Write a learned drafter's graphs into a bundle (next to the target) and check their parity.

    medusa   medusa/medusa.onnx
    eagle    eagle/layer.onnx
    eagle3   eagle3/layer.onnx, eagle3/fuse.onnx, eagle3/vocab_ids.npy (draft id -> target id)
    mtp      mtp/module_{k}.onnx, one per module

Each graph's ONNX Runtime output is compared with the PyTorch module (prefill rows, then a small
tree) before the bundle is renamed into place.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from specrt.engines.ort_cpu.runner import OrtDecoder, session_options
from specrt.errors import SpecrtError
from specrt.export.drafters.graphs import feature_graph, fuse_graph, medusa_graph
from specrt.plugins.onnx_builder import OPSET
from specrt.schema.manifest import GraphEntry, sha256_file

PARITY_TOLERANCE = 1e-3

# Medusa-style "choices": more candidates near the root, where the heads are more often right.
MEDUSA_TREE = [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


def medusa_tree(num_heads: int) -> list[list[int]]:
    return [p for p in MEDUSA_TREE if len(p) <= num_heads]


def _save(model: onnx.ModelProto, path: Path, role: str, cfg, source: str) -> GraphEntry:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = path.name + ".data"
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location=data,
                    size_threshold=1024)
    files = [f for f in (path, path.parent / data) if f.is_file()]
    return GraphEntry(role=role, file=f"{path.parent.name}/{path.name}", config=cfg,
                      inputs=[i.name for i in model.graph.input], outputs=[o.name for o in model.graph.output],
                      opset=OPSET, source=source, sha256={f.name: sha256_file(f) for f in files})


def feature_parity(module, path: Path, prompt_len: int = 8) -> float:
    """Max |Δ| over logits and features: prefill rows, then a 3-node tree."""
    cfg = module.dec
    capacity = prompt_len + 4
    dec = OrtDecoder(path, cfg, capacity, threads=os.cpu_count() or 1)
    kv = module.new_kv(1, capacity)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len + 3), generator=gen)
    hidden = torch.randn(1, prompt_len + 3, cfg.hidden_size, generator=gen)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    worst = 0.0
    for a, b, mask in ((0, prompt_len, torch.tril(torch.ones(prompt_len, prompt_len, dtype=torch.bool))),
                       (prompt_len, prompt_len + 3, tree)):
        pos, past = torch.arange(a, b)[None], torch.tensor([a])
        want_logits, want_out = module.step(ids[:, a:b], hidden[:, a:b], pos, past, mask[None], kv)
        got_logits, got_out = dec.run(ids[:, a:b].numpy(), pos.numpy(), past.numpy(), mask[None].numpy(),
                                      np.arange(b - a)[None], hidden_in=hidden[:, a:b].numpy())
        worst = max(worst, float(np.abs(got_logits - want_logits.numpy()).max()),
                    float(np.abs(got_out - want_out.numpy()).max()))
    return worst


def _session_parity(path: Path, feeds: dict, want: torch.Tensor) -> float:
    s = ort.InferenceSession(str(path), session_options(os.cpu_count() or 1), providers=["CPUExecutionProvider"])
    return float(np.abs(s.run(None, {k: v.numpy() for k, v in feeds.items()})[0] - want.detach().numpy()).max())


def export_drafter(module, tmp: Path, target_cfg, source: str, check_parity: bool = True) -> tuple[dict, dict]:
    """Write `module`'s graphs under tmp/<kind>/; returns (graph entries by role, manifest entry)."""
    kind = module.cfg.kind
    folder = tmp / kind
    graphs: dict[str, GraphEntry] = {}
    parity: dict[str, float] = {}
    entry = {"kind": kind, "config": asdict(module.cfg), "source": source}
    gen = torch.Generator().manual_seed(0)
    if kind == "medusa":
        graphs["medusa"] = _save(medusa_graph(module), folder / "medusa.onnx", "medusa", target_cfg, source)
        entry["tree"] = medusa_tree(module.cfg.num_heads)
        if check_parity:
            h = torch.randn(1, 2, target_cfg.hidden_size, generator=gen)
            with torch.no_grad():
                parity["medusa"] = _session_parity(tmp / graphs["medusa"].file, {"hidden_in": h}, module(h))
    elif kind in ("eagle", "eagle3"):
        graphs[kind] = _save(feature_graph(module, kind), folder / "layer.onnx", kind, module.dec, source)
        if kind == "eagle3":
            graphs["eagle3_fuse"] = _save(fuse_graph(module), folder / "fuse.onnx", "eagle3_fuse", target_cfg, source)
            np.save(folder / "vocab_ids.npy", module.target_ids().numpy().astype(np.int64))
            entry.update(vocab_ids=f"{kind}/vocab_ids.npy", taps=list(module.cfg.taps))
            if check_parity:
                a = torch.randn(1, 3, module.fc.in_features, generator=gen)
                with torch.no_grad():
                    parity["eagle3_fuse"] = _session_parity(tmp / graphs["eagle3_fuse"].file,
                                                            {"aux_hidden_states": a}, module.fuse(a))
        if check_parity:
            parity[kind] = feature_parity(module, tmp / graphs[kind].file)
    elif kind == "mtp":
        for k, m in enumerate(module.mtp):
            role = f"mtp.{k}"
            graphs[role] = _save(feature_graph(m, role), folder / f"module_{k}.onnx", role, m.dec, source)
            if check_parity:
                parity[role] = feature_parity(m, tmp / graphs[role].file)
    else:
        raise SpecrtError(f"drafter kind {kind!r} has no graph export (the draft model is exported as role 'draft')")
    for role, worst in parity.items():
        if worst > PARITY_TOLERANCE:
            raise SpecrtError(f"{role} graph parity failed: max |Δ| {worst:.2e} > {PARITY_TOLERANCE}; please report this")
    entry.update(graphs=list(graphs), parity_max_abs=parity)
    return graphs, entry

