"""Medusa: K heads read the target's hidden state of the second-newest committed token and draft a
static tree; a node at depth d takes head d's r-th candidate (r = its rank among siblings), as in
Medusa's "choices". With sampling, each node is an i.i.d. draw from head d's warped distribution
(recorded as q), so rejection sampling stays lossless. The heads run on the native kernels where the target
does and the graph is int4 (engines/native/medusa.py; the `drafter_layers` branch), else on ONNX Runtime."""

from __future__ import annotations

from specrt.runtime.drafters import Drafter, DrafterContext, Proposal
from specrt.runtime.drafters.features import TargetState, layer_backend
from specrt.runtime.drafters.static_tree import expand_by_depth
from specrt.runtime.drafters.vocab import DraftVocab
from specrt.runtime.sampling import SamplingParams


class MedusaDrafter(Drafter):
    name = "medusa"
    needs_hidden = True

    def __init__(self, ctx: DrafterContext):
        entry = ctx.manifest.drafter("medusa", ctx.bundle)
        self.heads = int(entry["config"]["num_heads"])
        role = entry["graphs"][0]
        path = ctx.manifest.onnx_path(ctx.bundle, role)
        self.backend, self.record = layer_backend(path, ctx.manifest.graphs[role].config, ctx.backend, graph="medusa")
        if self.backend == "native":
            from specrt.engines.native.medusa import NativeMedusaHeads

            heads = NativeMedusaHeads(path, ctx.threads)
            self._logits = lambda hidden: heads.run(hidden[None])[0]  # noqa: E731
        else:
            session = ctx.session(role)
            self._logits = lambda hidden: session.run(None, {"hidden_in": hidden[None, None]})[0][0, 0]  # noqa: E731
        self.vocab = DraftVocab.of(ctx, entry)
        self.shape = ctx.tree
        self.state: TargetState | None = None

    calls = 0  # head-session runs

    @property
    def engine_calls(self) -> int:
        return self.calls

    def observe(self, tokens: list[int], state: TargetState | None = None) -> None:
        self.state = state

    def propose(self, tokens, max_nodes, max_depth, sampling: SamplingParams, rng) -> Proposal:
        shape = self.shape
        keep = shape.kept(max_nodes, min(max_depth, self.heads))
        if len(tokens) < 2 or not keep:
            return Proposal()
        self.calls += 1
        logits = self._logits(self.state.hidden[len(tokens) - 2])  # [K, V']: head d drafts depth d+1
        return expand_by_depth(shape, keep, logits, self.vocab, sampling, rng)
