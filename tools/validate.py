"""`specrt validate --lossless`: speculative sampling on the bundle's own graphs follows the target.

Exact target distribution of the next L tokens after a fixed prompt, under a narrow warp (top-k)
so it can be enumerated with a handful of target passes; then N speculative generations with the
chosen drafter and tree; Pearson's chi-square decides (see tools/lossless.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from specrt.runtime.generate import Generator
from specrt.runtime.sampling import SamplingParams, warp
from specrt.schema.manifest import Manifest
from specrt.tools.lossless import ChiSquare, chi_square

# Repetitive on purpose: prompt lookup then drafts tokens the target often samples, so the check
# exercises acceptance and sibling rejection, not only the fallback draw.
PROMPT = "Repeat this list exactly: red, green, blue, red, green, blue, red, green, blue."


def exact_distribution(gen: Generator, prompt: list[int], params: SamplingParams, length: int) -> dict[tuple, float]:
    """P(next `length` tokens) under the warped target, by enumerating the support (top-k)."""
    out: dict[tuple, float] = {}
    first = warp(gen.forward(prompt, 0, rows=[len(prompt) - 1])["logits"][0, 0], params)  # the prompt's rows stay valid
    frontier = [((), 1.0, first)]
    for depth in range(length):
        nxt = []
        for prefix, prob, dist in frontier:
            for tok in np.flatnonzero(dist > 0).tolist():
                seq, p = (*prefix, tok), prob * float(dist[tok])
                if depth + 1 == length:
                    out[seq] = p
                else:
                    logits = gen.forward([prompt[-1], *seq], len(prompt) - 1)["logits"][0, -1]
                    nxt.append((seq, p, warp(logits, params)))
        frontier = nxt
    return out


class PromptReuse:
    """Many generations after one prompt, its prefill run once.

    The first generation prefills as usual; later ones start from the KV rows (and, for a feature
    drafter, the target-feature rows) that prefill left at rows 0..n-1, and from its last logits. A
    generation only ever writes rows from n on (its verify windows start at the last committed token,
    row n or later), so those rows still hold the bytes the prefill wrote: each later generation sees
    exactly what a fresh prefill would give it on this machine, and the drafter observes the same
    tokens and features. Only this generator's own generations may run in between."""

    def __init__(self, gen: Generator):
        self.gen = gen
        self.prompt: list[int] | None = None
        self.logits: np.ndarray | None = None

    def generate(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams):
        seq = self.gen.sequence(prompt, max_new_tokens, sampling)
        if self.prompt != prompt:
            self.prompt, self.logits = list(prompt), seq.run_prefill(self.gen.run_pass).copy()
        seq.prefilled(self.logits)
        while seq.step(self.gen.run_pass) is not None:
            pass
        return seq.result()


def lossless_check(bundle: Path, drafter: str = "ngram", tree: str | None = "default", samples: int = 1000,
                   length: int = 3, top_k: int = 4, temperature: float = 1.0, seed: int = 0,
                   threads: int = 2, progress: bool = True) -> tuple[ChiSquare, dict]:
    # allow_inexact: the check must run the speculation it certifies, never a plain fall-back
    capacity = min(256, Manifest.load(bundle).target.config.max_position_embeddings)
    gen = Generator(bundle, drafter=drafter, tree=tree, max_seq_len=capacity, threads=threads, allow_inexact=True)
    prompt = gen.tokenizer.encode_prompt(PROMPT)
    params = SamplingParams(temperature=temperature, top_k=top_k)
    exact = exact_distribution(gen, prompt, params, length)
    seqs, accepted, steps = [], 0, 0
    reuse = PromptReuse(gen)
    for i in tqdm(range(samples), desc="validate --lossless", unit="sample", disable=not progress):
        res = reuse.generate(prompt, length, SamplingParams(temperature, top_k, 1.0, seed=seed + i))
        seqs.append(tuple(res.token_ids[:length]))
        accepted += res.stats.accepted
        steps += res.stats.steps
    result = chi_square(seqs, exact)
    detail = {"drafter": gen.drafter_name, "tree": tree or "chain", "length": length, "top_k": top_k,
              "temperature": temperature, "outcomes": len(exact), "accepted_drafts": accepted, "verify_steps": steps,
              "check": "Pearson chi-square vs the exact warped target distribution of the next tokens",
              "exec_mode": gen.exactness.mode.name, "batch_invariant": gen.exactness.lossless,
              "batch_invariance_reason": gen.exactness.reason}
    return result, detail
