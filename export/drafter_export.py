"""Write a learned drafter's graphs into a bundle (next to the target) and check their parity.

Each kind's graph writer (its spec's `graphs`, in export/drafters/<kind>.py) writes its files under
<kind>/ with `save_graph` and measures them with `feature_parity` / `session_parity`; `export_drafter`
runs it and refuses a graph whose ONNX Runtime output differs from the PyTorch module (prefill rows,
then a small tree) before the bundle is renamed into place.
"""

from __future__ import annotations

import json
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
from specrt.kinds import resolve
from specrt.plugins.onnx_builder import OPSET
from specrt.schema.digests import file_digests
from specrt.schema.manifest import GraphEntry

PARITY_TOLERANCE = 1e-3


def save_graph(model: onnx.ModelProto, path: Path, role: str, cfg, source: str) -> GraphEntry:
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
        embeds = module.embed_tokens(ids[:, a:b].clamp(min=0)).detach().numpy()  # the target's rows
        got_logits, got_out = dec.run(ids[:, a:b].numpy(), pos.numpy(), past.numpy(), mask[None].numpy(),
                                      np.arange(b - a)[None], hidden_in=hidden[:, a:b].numpy(), inputs_embeds=embeds)
        for got, want in ((got_logits, want_logits.numpy()), (got_out, want_out.numpy())):
            worst = max(worst, float(np.abs(got - want).max()) / max(1.0, float(np.abs(want).max())))
    return worst


def vocab_ids_entry(ids, tmp: Path, role: str) -> dict:
    """ROLE/vocab_ids.npy (draft id -> target id) and the manifest entry's `vocab_ids` naming it; {} where
    `ids` is None (the head covers the target's whole vocabulary)."""
    if ids is None:
        return {}
    (tmp / role).mkdir(parents=True, exist_ok=True)
    np.save(tmp / role / "vocab_ids.npy", np.asarray(ids, dtype=np.int64))
    return {"vocab_ids": f"{role}/vocab_ids.npy"}


def session_parity(path: Path, feeds: dict, want: torch.Tensor) -> float:
    s = ort.InferenceSession(str(path), session_options(os.cpu_count() or 1), providers=["CPUExecutionProvider"])
    return float(np.abs(s.run(None, {k: v.numpy() for k, v in feeds.items()})[0] - want.detach().numpy()).max())


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
             "graphs": list(graphs), "parity_max_abs": parity, **trained_acceptance(source)}
    return graphs, entry


def trained_acceptance(source: str) -> dict:
    """How often the head's drafts are accepted on held-out data, from the drafter folder's metrics.json (what
    runtime/shapes.py sizes default drafts by): "acceptance_by_depth" [a_1, ...] by draft step, and
    "acceptance_top_k" [a@1, ..., a@k], the first step's acceptance within its k best candidates. As the run
    time drafts where metrics.json has it ("run_time", from scripts/runtime_acceptance.py; then
    "acceptance_measured" is "run time"), else as training measured it ("final": teacher-forced top-1
    agreement). {} where there is neither (a public checkpoint, a random drafter)."""
    path = Path(source) / "metrics.json"
    try:
        metrics = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(metrics, dict):
        return {}
    run_time = _acceptance(metrics.get("run_time"), ("acceptance_by_depth", "acceptance_by_depth"),
                           ("acceptance_top_k", "acceptance_top_k"))
    if run_time:  # measured as the run time drafts (scripts/runtime_acceptance.py): ahead of training's
        return {**run_time, "acceptance_measured": "run time"}
    return _acceptance(metrics.get("final"), ("top1_per_step", "acceptance_by_depth"),
                       ("first_step_top_k", "acceptance_top_k"))


def _acceptance(record, *fields: tuple[str, str]) -> dict:
    """The manifest's acceptance fields from a metrics record's (field, manifest key) pairs; {} without a valid
    acceptance by depth."""
    out = {}
    for field, key in fields:
        accs = record.get(field) if isinstance(record, dict) else None
        if isinstance(accs, list) and accs and all(isinstance(a, (int, float)) and 0 <= a <= 1 for a in accs):
            out[key] = [round(float(a), 4) for a in accs]
    return out if "acceptance_by_depth" in out else {}
