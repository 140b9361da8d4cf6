"""How close a bundle's native int4 target is to the fp32 model of its source's values, teacher-forced.

    python scripts/model_quality.py BUNDLE [BUNDLE ...] [--prompts 10] [--tokens 48]

The reference is the source model (a GGUF: its values dequantized, as transformers loads them) in fp32
torch. For every N-th held-out prompt of the shipped corpus it writes the reference's own greedy answer,
then scores each bundle's native target on prompt + answer in one prefill: perplexity (and its ratio to
the reference's), top-1 agreement with the reference, and mean KL(reference ‖ bundle) per position.
Used for docs/quality.md; `tests/export/test_gguf_blocks.py` holds the default path to its bound.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundles", nargs="+", type=Path)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()

    from specrt.cli.train_cmd import _target_source
    from specrt.export.loading import load_model
    from specrt.export.training.corpus import load_prompts
    from specrt.export.training.datagen import encode
    from specrt.export.training.native_answers import NativePasses

    loaded = load_model(_target_source(args.bundles[0]), keep_hf=False)
    module = loaded.module

    @torch.no_grad()
    def logits(ids: list[int]) -> torch.Tensor:
        t = len(ids)
        out, _ = module(torch.tensor([ids]), torch.arange(t)[None], torch.tensor([0]),
                        torch.tril(torch.ones(t, t, dtype=torch.bool))[None], module.new_kv(1, t))
        return out[0].double()

    held = load_prompts("heldout")
    rows = held[:: max(1, len(held) // args.prompts)][: args.prompts]
    @torch.no_grad()
    def greedy(ids: list[int]) -> list[int]:
        """The reference's greedy answer, one cached row a step."""
        t = len(ids)
        kv = module.new_kv(1, t + args.tokens)
        out, _ = module(torch.tensor([ids]), torch.arange(t)[None], torch.tensor([0]),
                        torch.tril(torch.ones(t, t, dtype=torch.bool))[None], kv)
        ids = [*ids, int(out[0, -1].argmax())]
        for _ in range(args.tokens - 1):
            t = len(ids) - 1
            out, _ = module(torch.tensor([[ids[-1]]]), torch.tensor([[t]]), torch.tensor([t]),
                            torch.ones(1, 1, 1, dtype=torch.bool), kv)
            ids.append(int(out[0, -1].argmax()))
        return ids

    seqs = [greedy(encode(loaded, row["prompt"])) for row in rows]
    refs = [logits(ids[:-1]).log_softmax(-1) for ids in seqs]
    for bundle in args.bundles:
        native = NativePasses(bundle, 1, max(len(s) for s in seqs) + 1, (), threads=2)
        nll = ref_nll = kl = agree = n = 0.0
        for ids, ref in zip(seqs, refs, strict=True):
            got = native.prefill(0, ids[:-1])[0].double().log_softmax(-1)
            target = torch.tensor(ids[1:])[:, None]
            nll -= got.gather(1, target).sum().item()
            ref_nll -= ref.gather(1, target).sum().item()
            kl += (ref.exp() * (ref - got)).sum().item()
            agree += (got.argmax(-1) == ref.argmax(-1)).sum().item()
            n += len(target)
        print(json.dumps({"bundle": str(bundle), "positions": int(n), "perplexity": round(float(np.exp(nll / n)), 3),
                          "reference_perplexity": round(float(np.exp(ref_nll / n)), 3),
                          "ratio": round(float(np.exp((nll - ref_nll) / n)), 4), "top1_agreement": round(agree / n, 4),
                          "kl": round(kl / n, 4)}))


if __name__ == "__main__":
    main()
