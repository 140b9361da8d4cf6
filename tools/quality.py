"""`specrt validate --quality`: how close a bundle's target is to the fp32 model of its source's values.

Speculation is exact relative to the target, so the target must be the model the user gave. The
reference is the source model the bundle was exported from (a GGUF's values dequantized, or an HF
folder's), in fp32 torch. For every N-th held-out prompt of the shipped corpus it writes the reference's
own greedy answer (the prompts decoded as one batch, a cached row each a step); the bundle's target, on the
backend the runtime would pick, scores prompt + answer in one pass. Reported per position: perplexity and its ratio to the reference's,
top-1 agreement, mean KL(reference ‖ target). The verdict holds the ratio and the agreement to bounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from specrt.errors import SpecrtError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Bounds:
    max_ratio: float = 1.02  # perplexity at most 2 % above the reference's
    min_top1: float = 0.95  # the reference's top-1 at ≥ 95 % of positions


def verdict(report: dict, bounds: Bounds) -> str:
    ok = report["ratio"] <= bounds.max_ratio and report["top1_agreement"] >= bounds.min_top1
    return "pass" if ok else "fail"


def greedy_references(module, prompts: list[list[int]], tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """The torch `module`'s greedy answer of `tokens` tokens to each prompt, and its log-probabilities (float64) at
    every position from the prompt's last on. Each prompt is prefilled alone (their lengths differ); the answers
    are decoded together, one batched step a token, so the fp32 weights stream once a step for every prompt."""
    import torch

    with torch.no_grad():
        kv = module.new_kv(len(prompts), max(map(len, prompts)) + tokens)
        ids, rows = [list(p) for p in prompts], [[] for _ in prompts]
        for b, p in enumerate(ids):
            t = len(p)
            out, _ = module(torch.tensor([p]), torch.arange(t)[None], torch.tensor([0]),
                            torch.tril(torch.ones(t, t, dtype=torch.bool))[None], [(k[b : b + 1], v[b : b + 1])
                                                                                   for k, v in kv])
            rows[b].append(out[0])
            p.append(int(out[0, -1].argmax()))
        for _ in range(tokens - 1):
            t = torch.tensor([len(p) - 1 for p in ids])
            out, _ = module(torch.tensor([[p[-1]] for p in ids]), t[:, None], t,
                            torch.ones(len(ids), 1, 1, dtype=torch.bool), kv)
            for b, p in enumerate(ids):
                rows[b].append(out[b])
                p.append(int(out[b, -1].argmax()))
    return [(p, torch.cat(r).double().log_softmax(-1)) for p, r in zip(ids, rows, strict=True)]


def quality_check(bundle: Path, prompts: int = 10, tokens: int = 48, threads: int = 2, backend: str = "auto",
                  bounds: Bounds = Bounds(), kv_dtype: str = "auto", source_model=None) -> dict:
    """`kv_dtype`: the target's KV cache (runtime/target.py kv_cache_dtype): what the prefill's attention reads.
    `source_model`: the bundle's source already loaded (export/loading.py `LoadedModel`), used instead of loading
    it again; it must be the file the bundle was exported from."""
    try:
        import torch

        from specrt.export.loading import load_model
        from specrt.export.training.corpus import load_prompts
        from specrt.export.training.datagen import encode
    except ImportError as e:
        raise SpecrtError(f"--quality runs the source model in torch ({e}): pip install 'specrt[export]'") from None
    from specrt.runtime.target import TargetModel
    from specrt.schema.manifest import Manifest

    source = Path(Manifest.load(bundle).target.source)
    if not source.exists():
        raise SpecrtError(f"--quality compares {bundle} with the model it was exported from, {source}, which no longer "
                          "exists here: export the bundle again from a model on this machine")
    if source_model is None:
        loaded = load_model(source, keep_hf=False)
    elif Path(source_model.source).resolve() == source.resolve():
        loaded = source_model
    else:
        raise SpecrtError(f"{bundle} was exported from {source}, not from the model given, {source_model.source}")
    module = loaded.module

    held = load_prompts("heldout")
    rows = held[:: max(1, len(held) // prompts)][:prompts]
    seqs = greedy_references(module, [encode(loaded, row["prompt"]) for row in rows], tokens)
    target = TargetModel(bundle, max_seq_len=max(len(ids) for ids, _ in seqs) + 8, threads=threads, backend=backend,
                         kv_dtype=kv_dtype)
    nll = ref_nll = kl = agree = n = 0.0
    for ids, ref in seqs:
        got = torch.from_numpy(np.asarray(target.forward(ids[:-1], 0)["logits"][0], np.float64)).log_softmax(-1)
        answer = torch.tensor(ids[1:])[:, None]
        nll -= got.gather(1, answer).sum().item()
        ref_nll -= ref.gather(1, answer).sum().item()
        kl += (ref.exp() * (ref - got)).sum().item()
        agree += (got.argmax(-1) == ref.argmax(-1)).sum().item()
        n += len(answer)
    report = {"bundle": str(bundle), "backend": target.backend, "kv_dtype": target.kv_dtype,
              "reference": str(loaded.source), "prompts": len(rows),
              "positions": int(n), "perplexity": round(float(np.exp(nll / n)), 4),
              "reference_perplexity": round(float(np.exp(ref_nll / n)), 4),
              "ratio": round(float(np.exp((nll - ref_nll) / n)), 4), "top1_agreement": round(agree / n, 4),
              "kl": round(kl / n, 5), "bounds": {"max_ratio": bounds.max_ratio, "min_top1": bounds.min_top1}}
    return {**report, "verdict": verdict(report, bounds)}
