"""MTP drafting (DeepSeek recurrence): step k (module k, or the one module reused) continues step
k-1's hidden states one token further, each step with its own KV cache.

Row r of step k reads (x[r+1], out_{k-1}[r-1]) (step 1: the target's h[r]) and predicts x[r+2].
With committed x[0..m], every step's rows r ≤ m-1 are committed; step k also needs the drafted rows
m .. m+k-2 (reading drafts d1..d_{k-1}); its last row drafts d_k = x[m+k]. A chain of `num_steps`.
"""

from __future__ import annotations

import numpy as np

from specrt.plugins.rejection_sample import sample_from
from specrt.runtime.drafters import Drafter, DrafterContext, Proposal
from specrt.runtime.drafters.features import FeatureLayer, TargetState
from specrt.runtime.drafters.vocab import DraftVocab
from specrt.runtime.sampling import SamplingParams


class MtpDrafter(Drafter):
    name = "mtp"
    needs_hidden = True

    @classmethod
    def nominal_depth(cls, manifest, options: dict, tree) -> int:
        """A chain of the module's steps, whatever the tree."""
        return int(options.get("mtp_steps") or manifest.drafters["mtp"]["config"]["num_steps"])

    def __init__(self, ctx: DrafterContext):
        entry = ctx.manifest.drafter("mtp", ctx.bundle)
        self.steps = self.nominal_depth(ctx.manifest, ctx.options, None)
        modules = entry["graphs"]
        self.layers = []
        for k in range(self.steps):
            role = modules[min(k, len(modules) - 1)]
            self.layers.append(FeatureLayer(ctx.manifest.onnx_path(ctx.bundle, role),
                                            ctx.manifest.graphs[role].config, ctx.capacity + self.steps + 2, ctx.threads,
                                            ctx.backend, embedding=ctx.target_embedding))
        # committed-row outputs of each step (step k+1 reads step k's row r-1)
        self.outs = [np.zeros((ctx.capacity + 1, ctx.manifest.target.config.hidden_size), np.float32)
                     for _ in range(self.steps)]
        self.vocab = DraftVocab.of(ctx, entry)
        self.state: TargetState | None = None

    @property
    def engine_calls(self) -> int:
        return sum(layer.calls for layer in self.layers)

    def observe(self, tokens: list[int], state: TargetState | None = None) -> None:
        self.state = state
        for layer in self.layers:
            layer.sync(tokens)
        # a step's rows depend on the step before: never keep more rows than it keeps
        for k in range(1, self.steps):
            self.layers[k].cached = min(self.layers[k].cached, self.layers[k - 1].cached)

    def propose(self, tokens, max_nodes, max_depth, sampling: SamplingParams, rng) -> Proposal:
        m = len(tokens) - 1
        steps = min(self.steps, max_nodes, max_depth)
        if m < 1 or steps <= 0:
            return Proposal()
        drafts: list[int] = []
        qs = []
        prev_draft_out = None  # step k-1's outputs on its drafted rows m .. m+k-3
        for k in range(steps):
            layer = self.layers[k]
            start = min(layer.cached, m - 1)
            rows = np.arange(start, m + k)  # committed rows start..m-1, drafted rows m..m+k-1
            ids = [*tokens[start + 1 : m + 1], *drafts]
            if k == 0:
                feats = self.state.hidden[start:m]
            else:
                prev = np.concatenate([self.outs[k - 1][: m], prev_draft_out]) if prev_draft_out is not None \
                    else self.outs[k - 1][:m]
                src = rows - 1
                feats = np.where((src >= 0)[:, None], prev[np.maximum(src, 0)], 0.0)
            t = len(rows)
            logits, out = layer.run(ids, feats, rows, start, np.tril(np.ones((t, t), bool)), [t - 1])
            n_committed = m - start
            self.outs[k][start:m] = out[:n_committed]
            layer.cached = m
            prev_draft_out = out[n_committed:]
            if sampling.greedy:
                drafts.append(int(self.vocab.to_target(int(logits[0].argmax()))))
            else:
                q = self.vocab.dist(logits[0], sampling)
                drafts.append(sample_from(q, float(rng.random())))
                qs.append(q)
        return Proposal(drafts, list(range(len(drafts))), np.stack(qs) if qs else None)
