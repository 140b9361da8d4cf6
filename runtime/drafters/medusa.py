"""Medusa: K heads read the target's hidden state of the second-newest committed token and draft a
static tree; a node at depth d takes head d's r-th candidate (r = its rank among siblings), as in
Medusa's "choices". With sampling, each node is an i.i.d. draw from head d's warped distribution
(recorded as q), so rejection sampling stays lossless."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from specrt.engines.ort_cpu.runner import session_options
from specrt.plugins.rejection_sample import sample_from
from specrt.runtime.drafters import DrafterContext, Proposal, register, renumber
from specrt.runtime.drafters.features import TargetState
from specrt.runtime.sampling import SamplingParams, top_desc, warp


@register("medusa")
class MedusaDrafter:
    name = "medusa"
    needs_hidden = True

    def __init__(self, ctx: DrafterContext):
        entry = ctx.manifest.drafter("medusa", ctx.bundle)
        self.heads = int(entry["config"]["num_heads"])
        self.session = ort.InferenceSession(str(ctx.manifest.onnx_path(ctx.bundle, entry["graphs"][0])),
                                            session_options(ctx.threads, spin=False),
                                            providers=["CPUExecutionProvider"])
        self.shape = ctx.tree
        self.state: TargetState | None = None

    def observe(self, tokens: list[int], state: TargetState | None = None) -> None:
        self.state = state

    def propose(self, tokens, max_nodes, max_depth, sampling: SamplingParams, rng) -> Proposal:
        shape = self.shape
        depth_limit = min(max_depth, self.heads)
        keep = [i for i in range(1, min(shape.size, max_nodes + 1)) if shape.depth[i] <= depth_limit]
        if len(tokens) < 2 or not keep:
            return Proposal()
        hidden = self.state.hidden[len(tokens) - 2][None, None]
        logits = self.session.run(None, {"hidden_in": hidden})[0][0, 0]  # [K, V]
        out, q_rows = [], []
        if sampling.greedy:
            width = max(shape.ranks[i] for i in keep) + 1
            top = np.stack([top_desc(head, width) for head in logits])
            out = [int(top[shape.depth[i] - 1, shape.ranks[i]]) for i in keep]
        else:
            qs = {}
            for i in keep:
                d = int(shape.depth[i]) - 1
                if d not in qs:
                    qs[d] = warp(logits[d], sampling)
                out.append(sample_from(qs[d], float(rng.random())))
                q_rows.append(qs[d])
        return Proposal(out, renumber(keep, shape.parents), np.stack(q_rows) if q_rows else None)
