"""Other engines measured beside specrt in `specrt bench --peers` (optional: they need torch etc.).

Each factory takes the bundle's manifest and thread count and returns {name: run}, where
run(prompt_ids, max_new_tokens) -> (new token ids, seconds).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from specrt.errors import SpecrtError


def transformers_peers(manifest, threads: int) -> dict:
    """Hugging Face transformers `generate`, plain greedy, on the bundle's source model."""
    try:
        import torch

        from specrt.export.loading import load_model
    except ImportError:
        raise SpecrtError("the transformers peer needs torch and transformers: pip install 'specrt[export]'") from None
    torch.set_num_threads(threads)
    source = manifest.target.source
    hf = load_model(source).hf_model.eval()
    eos = list(manifest.target.config.eos_token_ids)

    def run(ids: list[int], max_new_tokens: int):
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.no_grad():
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=eos, pad_token_id=eos[0] if eos else None)
        return y[0, len(ids):].tolist(), time.perf_counter() - t0

    return {"transformers-plain": run}


PEERS: dict[str, Callable] = {"transformers": transformers_peers}


def make_peers(names: list[str], manifest, threads: int) -> dict:
    out = {}
    for n in names:
        if n not in PEERS:
            raise SpecrtError(f"unknown peer {n!r}: choose from {', '.join(sorted(PEERS))}")
        out.update(PEERS[n](manifest, threads))
    return out
