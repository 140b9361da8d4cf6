"""Write a learned drafter's graphs into a bundle (next to the target) and check their parity.

    medusa   medusa/medusa.onnx
    eagle    eagle/layer.onnx
    eagle3   eagle3/layer.onnx, eagle3/fuse.onnx, eagle3/vocab_ids.npy (draft id -> target id)
    block    block/layer.onnx, block/fuse.onnx, block/vocab_ids.npy (EAGLE-3's layout, mask rows)
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
from specrt.export.drafters import kind_spec
from specrt.export.drafters.graphs import feature_graph, fuse_graph, medusa_graph
from specrt.kinds import resolve
from specrt.plugins.onnx_builder import OPSET
from specrt.schema.digests import file_digests
from specrt.schema.manifest import GraphEntry

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
                      opset=OPSET, source=source, sha256=file_digests(*files))


def feature_parity(module, path: Path, prompt_len: int = 8, mask_rows: int = 0) -> float:
    """Max |Δ| over logits and features, relative to each output's largest |value| where that exceeds 1
    (a trained head's logits reach tens; fp32 sums in another order differ by ~1e-7 of that): prefill
    rows, then a 3-node tree (its last `mask_rows` nodes given the mask id, for the block drafter)."""
    cfg = module.dec
    capacity = prompt_len + 4
    dec = OrtDecoder(path, cfg, capacity, threads=os.cpu_count() or 1)
    kv = module.new_kv(1, capacity)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len + 3), generator=gen)
    if mask_rows:
        ids[:, -mask_rows:] = -1
    hidden = torch.randn(1, prompt_len + 3, cfg.hidden_size, generator=gen)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    worst = 0.0
    for a, b, mask in ((0, prompt_len, torch.tril(torch.ones(prompt_len, prompt_len, dtype=torch.bool))),
                       (prompt_len, prompt_len + 3, tree)):
        pos, past = torch.arange(a, b)[None], torch.tensor([a])
        want_logits, want_out = module.step(ids[:, a:b], hidden[:, a:b], pos, past, mask[None], kv)
        got_logits, got_out = dec.run(ids[:, a:b].numpy(), pos.numpy(), past.numpy(), mask[None].numpy(),
                                      np.arange(b - a)[None], hidden_in=hidden[:, a:b].numpy())
        for got, want in ((got_logits, want_logits.numpy()), (got_out, want_out.numpy())):
            worst = max(worst, float(np.abs(got - want).max()) / max(1.0, float(np.abs(want).max())))
    return worst


def _session_parity(path: Path, feeds: dict, want: torch.Tensor) -> float:
    s = ort.InferenceSession(str(path), session_options(os.cpu_count() or 1), providers=["CPUExecutionProvider"])
    return float(np.abs(s.run(None, {k: v.numpy() for k, v in feeds.items()})[0] - want.detach().numpy()).max())


def medusa_graphs(module, tmp: Path, target_cfg, source: str, check_parity: bool) -> tuple[dict, dict, dict]:
    """medusa/medusa.onnx and the static tree stored with it."""
    graphs = {"medusa": _save(medusa_graph(module), tmp / "medusa" / "medusa.onnx", "medusa", target_cfg, source)}
    parity = {}
    if check_parity:
        h = torch.randn(1, 2, target_cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            parity["medusa"] = _session_parity(tmp / graphs["medusa"].file, {"hidden_in": h}, module(h))
    return graphs, {"tree": medusa_tree(module.cfg.num_heads)}, parity


def eagle_graphs(module, tmp: Path, target_cfg, source: str, check_parity: bool) -> tuple[dict, dict, dict]:
    """eagle/layer.onnx: the one decoder layer over (token, feature)."""
    graphs = {"eagle": _save(feature_graph(module, "eagle"), tmp / "eagle" / "layer.onnx", "eagle", module.dec, source)}
    return graphs, {}, {"eagle": feature_parity(module, tmp / graphs["eagle"].file)} if check_parity else {}


def _fused_layer_graphs(module, tmp: Path, source: str, check_parity: bool, role: str, target_cfg,
                        mask_rows: int = 0) -> tuple[dict, dict, dict]:
    """ROLE/layer.onnx, ROLE/fuse.onnx (low/mid/high features -> one) and ROLE/vocab_ids.npy: EAGLE-3's
    layout, which the block drafter shares (its parity also run with `mask_rows` mask rows)."""
    folder, fuse = tmp / role, f"{role}_fuse"
    graphs = {role: _save(feature_graph(module, role), folder / "layer.onnx", role, module.dec, source),
              fuse: _save(fuse_graph(module, fuse), folder / "fuse.onnx", fuse, target_cfg, source)}
    np.save(folder / "vocab_ids.npy", module.target_ids().numpy().astype(np.int64))
    parity = {}
    if check_parity:
        a = torch.randn(1, 3, module.fc.in_features, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            parity[fuse] = _session_parity(tmp / graphs[fuse].file, {"aux_hidden_states": a}, module.fuse(a))
        parity[role] = max(feature_parity(module, tmp / graphs[role].file, mask_rows=m) for m in {0, mask_rows})
    return graphs, {"vocab_ids": f"{role}/vocab_ids.npy", "taps": list(module.cfg.taps)}, parity


def eagle3_graphs(module, tmp: Path, target_cfg, source: str, check_parity: bool) -> tuple[dict, dict, dict]:
    """eagle3/layer.onnx, eagle3/fuse.onnx and eagle3/vocab_ids.npy (draft id -> target id)."""
    return _fused_layer_graphs(module, tmp, source, check_parity, "eagle3", target_cfg)


def block_graphs(module, tmp: Path, target_cfg, source: str, check_parity: bool) -> tuple[dict, dict, dict]:
    """block/layer.onnx, block/fuse.onnx, block/vocab_ids.npy (EAGLE-3's layout) and its static tree."""
    graphs, extra, parity = _fused_layer_graphs(module, tmp, source, check_parity, "block", target_cfg, mask_rows=2)
    return graphs, {**extra, "tree": medusa_tree(module.cfg.block_size)}, parity


def mtp_graphs(module, tmp: Path, target_cfg, source: str, check_parity: bool) -> tuple[dict, dict, dict]:
    """mtp/module_{k}.onnx, one per MTP module."""
    graphs, parity = {}, {}
    for k, m in enumerate(module.mtp):
        role = f"mtp.{k}"
        graphs[role] = _save(feature_graph(m, role), tmp / "mtp" / f"module_{k}.onnx", role, m.dec, source)
        if check_parity:
            parity[role] = feature_parity(m, tmp / graphs[role].file)
    return graphs, {}, parity


def export_drafter(module, tmp: Path, target_cfg, source: str, check_parity: bool = True) -> tuple[dict, dict]:
    """Write `module`'s graphs under tmp/<kind>/ with its kind's graph writer (specrt/kinds/); returns
    (graph entries by role, manifest entry)."""
    kind = module.cfg.kind
    spec = kind_spec(kind)
    if spec.graphs is None:
        raise SpecrtError(f"drafter kind {kind!r} has no graph export (it is exported as role {spec.bundle_role!r})")
    graphs, extra, parity = resolve(spec.graphs)(module, tmp, target_cfg, source, check_parity)
    for role, worst in parity.items():
        if worst > PARITY_TOLERANCE:
            raise SpecrtError(f"{role} graph parity failed: max |Δ| {worst:.2e} > {PARITY_TOLERANCE}; please report this")
    entry = {"kind": kind, "config": asdict(module.cfg), "source": source, **extra,
             "graphs": list(graphs), "parity_max_abs": parity}
    return graphs, entry
