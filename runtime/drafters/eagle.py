"""EAGLE-1 (static tree), EAGLE-2 (dynamic tree) and EAGLE-3 drafters over one feature layer.

With committed tokens x[0..m] (x[m] the newest, its target hidden state not known yet) the layer's
committed rows are r = 0..m-1: (x[r+1], f[r]) with f the target's features. Row m-1's output
drafts x[m+1]. A tree node at depth d is the row at position m-1+d reading its own token and its
parent's output feature; each level is one pass over the nodes so far with the tree mask (ancestors
only), logits computed for the newest level only.

    eagle    static tree (the generator's --tree), children = top-r (greedy) or i.i.d. draws
    eagle2   dynamic tree (EAGLE-2): expand the `beam` best nodes per depth by cumulative draft
             probability, keep the `tree_nodes` best of all candidates (greedy; with sampling the
             static tree is used, since value-based pruning of sampled children is not lossless).
             Given neither, the drafter runs the shape runtime/shapes.py sizes to this machine's verify
             costs and the head's acceptance (a CPU: one or two drafts, the first step fanned to its two
             or three best candidates where training counted how often they hold the target's token),
             where the generator has a cost curve (runtime/costs.py); else a tree of DEFAULT_TREE_NODES
             nodes, DEFAULT_BEAM wide
    eagle3   EAGLE-3 weights (fused low/mid/high target features, reduced vocabulary) with the
             EAGLE-2 dynamic tree
"""

from __future__ import annotations

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime.drafters import Drafter, DrafterContext, Proposal
from specrt.runtime.drafters.features import FeatureLayer, TargetState
from specrt.runtime.drafters.static_tree import expand_static
from specrt.runtime.drafters.vocab import DraftVocab
from specrt.runtime.sampling import SamplingParams, top_desc
from specrt.runtime.shapes import Shape, chain_shape, layer_weights

DEFAULT_BEAM, DEFAULT_TREE_NODES = 4, 10


def top_probability(logits: np.ndarray, best: int) -> float:
    """softmax(logits)[best] (`best` the argmax)."""
    return float(1.0 / np.exp(logits.astype(np.float64) - logits[best]).sum())


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


class _Nodes:
    """Drafted nodes (index 0 = root): token, parent, depth, feature out, logits, score."""

    def __init__(self, root_logits: np.ndarray, root_feature: np.ndarray):
        self.token, self.parent, self.depth, self.score = [-1], [-1], [0], [0.0]
        self.feature = {0: root_feature}
        self.logits = {0: root_logits}

    def add(self, token: int, parent: int, score: float = 0.0) -> int:
        self.token.append(int(token))
        self.parent.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.score.append(score)
        return len(self.token) - 1

    def ancestors(self, nodes) -> list[int]:
        """`nodes` plus all their non-root ancestors, parents first."""
        out: set[int] = set()
        for n in nodes:
            while n > 0 and n not in out:
                out.add(n)
                n = self.parent[n]
        return sorted(out, key=lambda n: (self.depth[n], n))


class EagleDrafter(Drafter):
    name = "eagle"
    kind = "eagle"
    dynamic = False

    def __init__(self, ctx: DrafterContext):
        entry = ctx.manifest.drafter(self.kind, ctx.bundle)
        self.entry, self.shape = entry, ctx.tree
        self.beam = int(ctx.options.get("beam") or DEFAULT_BEAM)
        self.fan = 1  # a chosen shape's first-step width (runtime/shapes.py)
        self.keep_confidence = False  # a chain's proposals carry their drafts' confidence (scripts/draft_confidence.py)
        self.tree_nodes = int(ctx.options.get("tree_nodes") or DEFAULT_TREE_NODES)
        self.depth = max(int(ctx.tree.depth.max()), 1)
        cfg = self.layer_cfg = ctx.manifest.graphs[entry["graphs"][0]].config
        self.vocab = DraftVocab.of(ctx, entry)  # the head's draft vocabulary (EAGLE-3's always)
        self.chosen: Shape | None = None
        tree_given = bool(ctx.options.get("beam") or ctx.options.get("tree_nodes"))
        if ctx.options.get("fan"):
            if tree_given or not self.dynamic:
                raise SpecrtError(f"--fan widens the first step of a dynamic drafter's chain ({self.name} "
                                  f"{'drafts a static tree' if not self.dynamic else 'was given --beam / --tree-nodes'}): "
                                  "drop --fan, or use it alone with eagle2/eagle3")
            self.fan, self.beam = int(ctx.options["fan"]), 1
            self.tree_nodes = self.fan + self.depth - 1
        elif self.dynamic and not tree_given:
            self._size_to_costs(ctx, entry)
        graphs = [ctx.manifest.onnx_path(ctx.bundle, g) for g in entry["graphs"]]
        self.layer = FeatureLayer(graphs[0], cfg, ctx.capacity + self.scratch_rows(), ctx.threads, ctx.backend,
                                  graphs[1] if len(graphs) > 1 else None, ctx.target_embedding)
        self.state: TargetState | None = None

    needs_hidden = True

    def _size_to_costs(self, ctx: DrafterContext, entry: dict) -> None:
        """No shape given: the chain runtime/shapes.py prices best on this machine's verify curve (where the
        generator has one; else EAGLE-2's tree of DEFAULT_TREE_NODES nodes, DEFAULT_BEAM wide)."""
        curve = ctx.costs()
        if curve is None:
            return
        self.chosen = chain_shape(curve, entry, self.pass_share(ctx.manifest.target.config), self.depth)
        self.beam, self.tree_nodes, self.depth = self.chosen.beam, self.chosen.nodes, self.chosen.depth
        self.fan = self.chosen.width
        ctx.note(self.chosen.describe(self.name, curve))

    def pass_share(self, target) -> float:
        """What one draft pass streams as a share of a one-row target pass: one layer over [embedding; feature]
        (EAGLE-3's q/k/v read both; EAGLE-1/2's fc does) and the head over the draft vocabulary, against the
        whole target (`target` its config)."""
        cfg = self.layer_cfg
        return layer_weights(cfg, 2 * cfg.hidden_size, len(self.vocab), 1) / \
            layer_weights(target, target.hidden_size, target.vocab_size, target.num_layers)

    def scratch_rows(self) -> int:
        """Feature-layer rows a step's drafted nodes may take after the committed ones (which end
        before capacity - 1: a step proposes only with a KV row left). A pass covers the nodes it
        computes and their ancestors: at most every static-tree node (EAGLE-1; EAGLE-2/3 when
        sampling), or the `beam` nodes kept at each depth the dynamic tree expands (depth - 1 passes
        of up to beam · d rows) — whatever `max_nodes` leaves of the tree, since the expansion ranks
        all candidates before the best are kept."""
        static = self.shape.size - 1
        return max(static, self.beam * (self.depth - 1)) if self.dynamic else static

    def features(self, start: int, end: int) -> np.ndarray:
        return self.state.hidden[start:end]

    taps = None  # EAGLE-3: the target's tapped rows (start, end), which its fuse turns into features

    @property
    def engine_calls(self) -> int:
        return self.layer.calls

    def observe(self, tokens: list[int], state: TargetState | None = None) -> None:
        self.state = state
        self.layer.sync(tokens)

    # ── the step ────────────────────────────────────────────────────────────────────────────
    def propose(self, tokens, max_nodes, max_depth, sampling: SamplingParams, rng) -> Proposal:
        m = len(tokens) - 1
        if m < 1 or max_nodes <= 0 or max_depth <= 0:
            return Proposal()
        root_logits, out = self.layer.catch_up(tokens, self.features, m, taps=self.taps)
        nodes = _Nodes(root_logits, out[-1])
        depth = min(self.depth, max_depth)
        if not (self.dynamic and sampling.greedy):
            return self._static(nodes, m, depth, max_nodes, sampling, rng)
        budget = min(self.tree_nodes, max_nodes)
        if self.beam == 1 and self.fan > 1 and budget > 1:
            width = min(self.fan, budget)
            return self._fan(nodes, m, width, min(depth, budget - width + 1))
        if self.beam == 1:  # a chain: the greedy path, no ranking
            chain, held = self._chain(nodes, m, min(depth, budget))
            return Proposal(chain, list(range(len(chain))), confidence=held if self.keep_confidence else None)
        keep = self._dynamic(nodes, m, min(depth, budget), budget)  # a kept node's ancestors are kept: depth ≤ budget
        slot = {n: i + 1 for i, n in enumerate(keep)}
        return Proposal([nodes.token[n] for n in keep], [slot.get(nodes.parent[n], 0) for n in keep])

    def _pass(self, nodes: _Nodes, m: int, todo: list[int]) -> None:
        """Compute features and logits of nodes `todo` (one pass over them and their ancestors)."""
        rows = nodes.ancestors(todo)
        index = {n: i for i, n in enumerate(rows)}
        mask = np.eye(len(rows), dtype=bool)
        for i, n in enumerate(rows):
            p = nodes.parent[n]
            if p > 0:
                mask[i] |= mask[index[p]]
        hidden = np.stack([nodes.feature[nodes.parent[n]] for n in rows])
        logits, out = self.layer.run([nodes.token[n] for n in rows], hidden,
                                     [m - 1 + nodes.depth[n] for n in rows], m, mask, [index[n] for n in todo])
        for j, n in enumerate(todo):
            nodes.logits[n] = logits[j]
            nodes.feature[n] = out[index[n]]

    def _static(self, nodes: _Nodes, m, depth, max_nodes, sampling, rng) -> Proposal:
        """The generator's static tree, expanded by the shared level walk over the layer's logits."""
        window = {0: 0}  # shape node -> drafted node

        def evaluate(level: list[int], drafted: dict[int, int]) -> None:
            for i in level:
                window[i] = nodes.add(drafted[i], window[self.shape.parents[i]])
            self._pass(nodes, m, [window[i] for i in level])

        return expand_static(self.shape, self.shape.kept(max_nodes, depth), sampling, rng,
                             ranked=lambda p, n: self.vocab.top(nodes.logits[window[p]], n),
                             dist=lambda p: self.vocab.dist(nodes.logits[window[p]], sampling), evaluate=evaluate)

    def _chain(self, nodes: _Nodes, m: int, depth: int) -> tuple[list[int], list[float]]:
        """The dynamic tree with beam 1: each depth's one child is its parent's argmax, and a budget of n nodes
        keeps the n shallowest (scores only fall with depth), so the chain of `depth` tokens is what _dynamic
        keeps, found without its log-softmax and sorts (a fifth of a chain-of-1 step's proposing). Also each
        draft's confidence where `keep_confidence`: the product of the chain's top-1 probabilities down to it
        (scripts/draft_confidence.py measures how well it predicts acceptance; off the hot path otherwise)."""
        p, out, held, sure = 0, [], [], 1.0
        for d in range(1, depth + 1):
            logits = nodes.logits[p]
            best = int(logits.argmax())
            if self.keep_confidence:
                sure *= top_probability(logits, best)
                held.append(sure)
            p = nodes.add(int(self.vocab.to_target(best)), p)
            out.append(nodes.token[p])
            if d < depth:
                self._pass(nodes, m, [p])
        return out, held

    def _fan(self, nodes: _Nodes, m: int, width: int, depth: int) -> Proposal:
        """The chain of `depth` drafts with the first step's next `width` - 1 best candidates beside its first
        (window slots 1..width): `width` + `depth` - 1 nodes for the chain's `depth` draft passes."""
        chain, _ = self._chain(nodes, m, depth)
        ranked = (int(t) for t in self.vocab.top(nodes.logits[0], width))
        others = [t for t in ranked if t != chain[0]][: width - 1]
        first = 1 + len(others)
        return Proposal([chain[0], *others, *chain[1:]],
                        [0] * first + ([1, *range(first + 1, first + len(chain) - 1)] if len(chain) > 1 else []))

    def _dynamic(self, nodes: _Nodes, m: int, depth: int, budget: int) -> list[int]:
        frontier = [0]
        for d in range(1, depth + 1):
            cands = []
            for p in frontier:
                lp = _log_softmax(nodes.logits[p].astype(np.float64))
                top = top_desc(lp, self.beam)
                for t in top:
                    cands.append(nodes.add(int(self.vocab.to_target(t)), p, nodes.score[p] + float(lp[t])))
            if d == depth:
                break
            frontier = sorted(cands, key=lambda n: -nodes.score[n])[: self.beam]
            self._pass(nodes, m, frontier)
        best = sorted(range(1, len(nodes.token)), key=lambda n: -nodes.score[n])[:budget]
        return nodes.ancestors(best)[:budget]  # ancestors score higher (ties aside); cut the deepest


class Eagle1(EagleDrafter):
    pass


class Eagle2(EagleDrafter):
    name = "eagle2"
    dynamic = True


class Eagle3(EagleDrafter):
    name = "eagle3"
    kind = "eagle3"
    dynamic = True

    def taps(self, start: int, end: int) -> np.ndarray:
        return self.state.aux[start:end]
