"""`specrt validate --quality`: how close a bundle's target is to the fp32 model of its source's values.

Speculation is exact relative to the target, so the target must be the model the user gave. The
reference is the source model the bundle was exported from (a GGUF's values dequantized, or an HF
folder's), in fp32 torch. For every N-th held-out prompt of the shipped corpus it writes the reference's
own greedy answer (one cached row a step); the bundle's target, on the backend the runtime would pick,
scores prompt + answer in one pass. Reported per position: perplexity and its ratio to the reference's,
top-1 agreement, mean KL(reference ‖ target). The verdict holds the ratio and the agreement to bounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError


@dataclass(frozen=True)
class Bounds:
    max_ratio: float = 1.02  # perplexity at most 2 % above the reference's
    min_top1: float = 0.95  # the reference's top-1 at ≥ 95 % of positions


def verdict(report: dict, bounds: Bounds) -> str:
    ok = report["ratio"] <= bounds.max_ratio and report["top1_agreement"] >= bounds.min_top1
    return "pass" if ok else "fail"


def quality_check(bundle: Path, prompts: int = 10, tokens: int = 48, threads: int = 2, backend: str = "auto",
                  bounds: Bounds = Bounds(), kv_dtype: str = "auto") -> dict:
    """`kv_dtype`: the target's KV cache (runtime/target.py kv_cache_dtype): what the prefill's attention reads."""
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
    loaded = load_model(source, keep_hf=False)
    module = loaded.module

    @torch.no_grad()
    def reference(ids: list[int]) -> tuple[list[int], torch.Tensor]:
        """The reference's greedy answer to `ids` and its log-probabilities at every position of the result."""
        t = len(ids)
        kv = module.new_kv(1, t + tokens)
        out, _ = module(torch.tensor([ids]), torch.arange(t)[None], torch.tensor([0]),
                        torch.tril(torch.ones(t, t, dtype=torch.bool))[None], kv)
        rows = [out[0]]
        ids = [*ids, int(out[0, -1].argmax())]
        for _ in range(tokens - 1):
            t = len(ids) - 1
            out, _ = module(torch.tensor([[ids[-1]]]), torch.tensor([[t]]), torch.tensor([t]),
                            torch.ones(1, 1, 1, dtype=torch.bool), kv)
            rows.append(out[0])
            ids.append(int(out[0, -1].argmax()))
        return ids, torch.cat(rows).double().log_softmax(-1)

    held = load_prompts("heldout")
    rows = held[:: max(1, len(held) // prompts)][:prompts]
    seqs = [reference(encode(loaded, row["prompt"])) for row in rows]
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
