"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024; vLLM's `method: suffix`): draft the continuations
that most often followed the context's suffix, in this sequence and in earlier ones. No model.

    match   every earlier occurrence of the context's last token, extended backwards (all at once, NumPy)
            to the longest common suffix with the context, at most MAX_MATCH tokens: in this sequence
            (prompt and output so far) and in the store of earlier sequences
    count   for a match length m, each occurrence of the context's m-token suffix votes for what followed
            it: a node's children are the tokens seen next, p(child) = count(child) / count(node)
    tree    best first: the candidate with the highest path probability (the product of the p's from the
            root) is added next, until the node budget, the depth (at most TOKENS_PER_MATCHED · m: a short
            match is weak evidence) or `suffix_min_prob`; one child per node when the generator's tree is
            a chain, else at most as many as the tree's widest node has
    choose  each distinct match length, in this sequence and in the store apart, gives a tree; the
            highest score (the sum of its path probabilities: the expected number of accepted tokens,
            were the counts the truth; a store tree's times STORE_WEIGHT, since another sequence is
            weaker evidence than this one) wins; on a tie this sequence's, then the longer match's

Each sequence is an append-only token array with an inverted index (token -> positions), extended as
tokens are committed (`observe`): a step costs O(occurrences of the last token × match length) for the
match and O(nodes × occurrences) for the tree. The store holds whole earlier sequences, oldest evicted
first, at most `suffix_store` tokens (default 65536, ~16 bytes each); it is indexed by sorting once after
each change. Drafts are deterministic (q=None): rejection sampling uses one-hot q, so greedy and sampled
output stay lossless.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from itertools import count

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime.drafters import Drafter, DrafterContext, Proposal

MAX_MATCH = 32  # longest suffix matched: beyond it a longer match rarely changes what follows
TOKENS_PER_MATCHED = 2  # an m-token match drafts at most 2m deep (as prompt lookup does)
DEFAULT_MIN_PROB = 0.1  # nodes whose path probability is below this are not drafted
DEFAULT_STORE_TOKENS = 65536  # tokens of earlier sequences kept (prompts and outputs); 0: no store
STORE_WEIGHT = 0.5  # earlier sequences are weaker evidence: a store draft's score counts half
TIE = 1e-9  # scores closer than this are a tie (rounding in the sums of products)
SEP = -1  # between stored sequences: matches and continuations never cross it
FEW_MATCHES = 8  # match_lengths walks this many positions back one by one, not as arrays
FEW_NEXT = 16  # children counts what follows this many positions in Python, not with np.unique


class SequenceIndex:
    """One sequence's tokens (`arr[:n]`, and as a list) with the positions of every token, appended to as
    tokens are committed."""

    def __init__(self, tokens=()):
        self.arr = np.empty(256, np.int32)
        self.n = 0
        self.tokens: list[int] = []
        self.where: dict[int, list[int]] = {}
        self.extend(list(tokens))

    def extend(self, new: list[int]) -> None:
        end = self.n + len(new)
        if end > len(self.arr):
            grown = np.empty(max(end, 2 * len(self.arr)), np.int32)
            grown[: self.n] = self.arr[: self.n]
            self.arr = grown
        self.arr[self.n : end] = new
        for i, tok in enumerate(new, self.n):
            self.where.setdefault(tok, []).append(i)
        self.tokens += new
        self.n = end

    def positions(self, tok: int) -> np.ndarray:
        return np.asarray(self.where.get(tok, ()), np.int64)


class StoreIndex:
    """A snapshot of the store: its sequences back to back, each followed by SEP, sorted once so the
    positions of a token are one binary search away."""

    def __init__(self, seqs):
        sep = np.array([SEP], np.int32)
        self.arr = np.concatenate([part for s in seqs for part in (s, sep)])
        self.n = len(self.arr)
        self.order = np.argsort(self.arr, kind="stable").astype(np.int32)
        self.sorted = self.arr[self.order]

    def positions(self, tok: int) -> np.ndarray:
        lo, hi = np.searchsorted(self.sorted, tok, "left"), np.searchsorted(self.sorted, tok, "right")
        return self.order[lo:hi].astype(np.int64)


class Store:
    """Earlier sequences (prompt and output) of this process, read by every drafter that shares it: at
    most `max_tokens` tokens in all, the oldest sequence evicted first (a sequence longer than the bound
    keeps its last `max_tokens`). Memory: about 16 bytes per token held (the tokens, the sorted index)."""

    def __init__(self, max_tokens: int = DEFAULT_STORE_TOKENS):
        if max_tokens < 0:
            raise SpecrtError(f"suffix_store {max_tokens} is negative: give the tokens to keep (0: no store)")
        self.max_tokens = int(max_tokens)
        self.seqs: deque[np.ndarray] = deque()
        self.tokens = 0
        self._index: StoreIndex | None = None

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, tokens) -> None:
        if self.max_tokens == 0 or len(tokens) == 0:
            return
        seq = np.asarray(tokens, np.int32)[-self.max_tokens :]
        self.seqs.append(seq)
        self.tokens += len(seq)
        while self.tokens > self.max_tokens:
            self.tokens -= len(self.seqs.popleft())
        self._index = None

    def clear(self) -> None:
        self.seqs.clear()
        self.tokens = 0
        self._index = None

    def index(self) -> StoreIndex | None:
        """The current snapshot (rebuilt after a change, at the next use); None while empty."""
        if self._index is None and self.seqs:
            self._index = StoreIndex(self.seqs)
        return self._index


def match_lengths(arr: np.ndarray, positions: np.ndarray, context: list[int],
                  max_match: int = MAX_MATCH) -> np.ndarray:
    """For each position p where `arr[p] == context[-1]`: the length of the longest common suffix of
    arr[..p] and `context`, at most `max_match`. Whole arrays of positions step back together; once at most
    FEW_MATCHES are still matching (a long match is rare), each walks back on its own (no per-step array
    overhead)."""
    top = min(max_match, len(context))
    lengths = np.ones(len(positions), np.int64)
    alive = np.arange(len(positions))
    j = 1
    while j < top and len(alive) > FEW_MATCHES:
        back = positions[alive] - j
        ok = back >= 0
        ok[ok] = arr[back[ok]] == context[-1 - j]
        alive = alive[ok]
        lengths[alive] += 1
        j += 1
    for i in alive.tolist():
        lengths[i] = _walk_back(arr, int(positions[i]), int(lengths[i]), context, top)
    return lengths


def _walk_back(arr: np.ndarray, p: int, m: int, context: list[int], top: int) -> int:
    """The match ending at position p of `arr`, known to be m tokens long, extended back as far as it goes."""
    while m < top and p - m >= 0 and arr[p - m] == context[-1 - m]:
        m += 1
    return m


def children(corpus, pos: np.ndarray, width: int) -> tuple[int, list]:
    """What followed a node whose token sits at positions `pos` (ascending) of `corpus`: (occurrences with
    a next token, [(token, count, its positions)] for the `width` most frequent next tokens, ties to the
    one seen last)."""
    if len(pos) <= FEW_NEXT:  # counted in Python: a Counter fed latest first keeps that order among equal counts
        after = [p + 1 for p in pos.tolist() if p + 1 < corpus.n]
        pairs = [(q, t) for q, t in zip(after, corpus.arr[after].tolist(), strict=True) if t != SEP]
        ranked = Counter(t for _, t in reversed(pairs)).most_common(width)
        return len(pairs), [(t, n, np.array([q for q, u in pairs if u == t], np.int64)) for t, n in ranked]
    nxt = pos + 1
    nxt = nxt[nxt < corpus.n]
    tok = corpus.arr[nxt]
    nxt, tok = nxt[tok != SEP], tok[tok != SEP]
    if tok.size <= 1:
        return tok.size, [(int(t), 1, nxt) for t in tok]
    uniq, last, counts = np.unique(tok[::-1], return_index=True, return_counts=True)  # last: latest first
    latest = nxt[::-1][last]
    return tok.size, [(int(uniq[i]), int(counts[i]), nxt[tok == uniq[i]])
                      for i in np.lexsort((-latest, -counts))[:width]]


def best_first(corpus, pos: np.ndarray, nodes: int, depth: int, width: int,
               min_prob: float) -> tuple[Proposal, list[float]]:
    """The draft tree of what followed the match ending at positions `pos` of `corpus`, grown best path
    probability first (so parents come before children, siblings in rank order, and every prefix of the
    nodes is a tree); (proposal, each node's path probability: their sum is the expected number of accepted
    tokens, were the counts the truth)."""
    if len(pos) == 1:  # one occurrence: what followed it, each token with probability 1
        end = min(pos[0] + 1 + min(depth, nodes), corpus.n)
        path = corpus.arr[pos[0] + 1 : end].tolist()
        path = path[: path.index(SEP)] if SEP in path else path
        return Proposal(path, list(range(len(path)))), [1.0] * len(path)
    prop, probs, tick, heap = Proposal(), [], count(), []

    def push(parent: int, prob: float, pos: np.ndarray, at: int) -> None:
        total, kids = children(corpus, pos, width)
        for tok, n, sub in kids:
            if (p := prob * n / total) >= min_prob:
                heapq.heappush(heap, (-p, next(tick), parent, tok, sub, at))

    push(0, 1.0, pos, 1)
    while heap and len(prop) < nodes:
        neg, _, parent, tok, sub, at = heapq.heappop(heap)
        prop.tokens.append(tok)
        prop.parents.append(parent)
        probs.append(-neg)
        if at < depth and len(prop) < nodes:
            push(len(prop), -neg, sub, at + 1)
    return prop, probs


class Suffix(Drafter):
    """Options (DrafterContext.options): `suffix_min_prob` (default 0.1: nodes less likely are not drafted),
    `suffix_store` (tokens of earlier sequences kept, default 65536; 0: this sequence only), `tree_nodes`
    (nodes per draft; default: the generator's tree's). Depth and width come from the generator's tree."""

    name = "suffix"

    def __init__(self, ctx: DrafterContext | None = None):
        opts = ctx.options if ctx else {}
        self.min_prob = float(opts.get("suffix_min_prob", DEFAULT_MIN_PROB))
        if not 0 <= self.min_prob <= 1:
            raise SpecrtError(f"suffix_min_prob {self.min_prob} is outside [0, 1]: it is a path probability")
        store = opts.get("suffix_store")
        self.store = Store(DEFAULT_STORE_TOKENS if store is None else int(store))
        tree = ctx.tree if ctx else None
        self.depth = int(tree.depth.max()) if tree is not None and tree.size > 1 else 5
        self.width = max(len(tree.children(i)) for i in range(tree.size)) if tree is not None else 1
        self.nodes = int(opts.get("tree_nodes") or (tree.size - 1 if tree is not None else self.depth))
        self.seq = SequenceIndex()

    # ── what it knows ───────────────────────────────────────────────────────────────────────
    def share(self, other: Drafter) -> None:
        if isinstance(other, Suffix):
            self.store = other.store

    def forget(self) -> None:
        self.store.clear()  # in place: the drafters sharing it forget too
        self.seq = SequenceIndex()

    def finish(self, tokens: list[int]) -> None:
        self.store.add(tokens)
        self.seq = SequenceIndex()

    def observe(self, tokens: list[int], state=None) -> None:
        self._sync(tokens)

    def _sync(self, tokens: list[int]) -> None:
        """Extend this sequence's index to `tokens`; a sequence that does not extend it is a new one (the
        generator reused for another prompt): the finished one goes to the store."""
        seen = self.seq.tokens
        n = len(seen)
        if len(tokens) >= n and (n == 0 or tokens[n - 1] == seen[-1] and tokens[:n] == seen):
            if len(tokens) > n:
                self.seq.extend(list(tokens[n:]))
        else:
            self.store.add(self.seq.tokens)
            self.seq = SequenceIndex(tokens)

    # ── drafting ────────────────────────────────────────────────────────────────────────────
    def propose(self, tokens, max_nodes, max_depth, sampling, rng) -> Proposal:
        return self.scored_nodes(tokens, max_nodes, max_depth)[0]

    def scored(self, tokens: list[int], max_nodes: int, max_depth: int) -> tuple[Proposal, float]:
        """The draft `propose` gives and its score: the tokens it expects accepted, were the counts the truth
        (a store draft's score weighted by STORE_WEIGHT)."""
        prop, scores = self.scored_nodes(tokens, max_nodes, max_depth)
        return prop, sum(scores)

    def scored_nodes(self, tokens: list[int], max_nodes: int, max_depth: int) -> tuple[Proposal, list[float]]:
        """`scored`'s draft and each node's share of its score (its path probability, weighted as the draft
        is), in window order: the first k nodes are a draft of their own, scored by the sum of the first k."""
        self._sync(tokens)
        depth, nodes = min(self.depth, max_depth), min(self.nodes, max_nodes)
        best, best_scores, best_score = Proposal(), [], 0.0
        if depth <= 0 or nodes <= 0 or not tokens:
            return best, best_scores
        store = self.store.index()
        # each corpus on its own, this sequence first: the store's counts never dilute this sequence's,
        # and a draft from the store wins only with more than 1/STORE_WEIGHT times this sequence's score
        for corpus in [self.seq] if store is None else [self.seq, store]:
            pos = corpus.positions(tokens[-1])
            if corpus is self.seq:
                pos = pos[pos < corpus.n - 1]  # not the context's own last token
            lengths = match_lengths(corpus.arr, pos, tokens)
            weight = 1.0 if corpus is self.seq else STORE_WEIGHT
            for m in sorted(set(lengths.tolist()), reverse=True):  # longest match first: it wins a tie
                cap = min(depth, TOKENS_PER_MATCHED * m)
                if weight * min(cap, nodes) <= best_score:  # each depth's path probabilities sum to at most 1
                    continue
                prop, probs = best_first(corpus, pos[lengths >= m], nodes, cap, self.width, self.min_prob)
                score = weight * sum(probs)
                if score > best_score + TIE:
                    best, best_scores, best_score = prop, [weight * q for q in probs], score
        return best, best_scores
