"""`Sequence` on its own: a scripted numpy target and a scripted drafter, no bundle.

The fake target is a tiny deterministic "model": the next token after a context is `model(context)`.
Its KV cache holds, per row, the token that row was computed from, and every pass reads its context
from that cache (rows below past_len) plus the window node's ancestors — as tree attention does — so a
wrong compaction or rollback changes what the target predicts next. The drafter drafts trees from a
script of (parent, right?) nodes: a right node carries the target's next token after its path, a
wrong one another token. Every expectation below is derived from the script and the model.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from specrt.runtime.drafters import Drafter, Proposal
from specrt.runtime.drafters.features import TargetState
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.sequence import Pass, Sequence
from specrt.runtime.settings import Request, SequenceTerms

V, H = 32, 2  # vocabulary and hidden size of the fake target
PROMPT = [3, 1, 4]
RIGHT, WRONG = True, False


def model(context: list[int]) -> int:
    """The fake target's next token: deterministic, depends on every token of the context (so a KV row
    holding the wrong token changes it)."""
    return (5 * context[-1] + 3 * sum(context) + len(context) + 1) % V


def plain_greedy(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(model(tokens))
    return tokens[len(prompt):]


def ancestry(parents, node: int) -> list[int]:
    """Window nodes from the root to `node`, both included."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


class FakeTarget:
    """One-hot logits (scaled) of `model` over each window node's context; KV rows hold tokens."""

    def __init__(self, capacity: int, scale: float = 100.0):
        self.kv = np.full(capacity, -1, np.int64)
        self.scale = scale
        self.passes: list[Pass] = []
        self.compactions: list[tuple[int, list[int]]] = []

    def run(self, p: Pass) -> dict:
        self.passes.append(p)
        prefix = self.kv[: p.past].tolist()  # what attention reads below past_len
        logits = np.zeros((len(p.window), V), np.float32)
        for i in range(len(p.window)):
            context = prefix + [int(p.window[j]) for j in ancestry(p.tree.parents, i)]
            logits[i, model(context)] = self.scale
        self.kv[p.past : p.past + len(p.window)] = p.window  # written in place at rows past..
        hidden = np.repeat(p.window.astype(np.float32)[:, None], H, axis=1)  # a node's "state": its token
        return {"logits": logits[p.rows][None], "hidden_states": hidden[None]}

    def compact(self, dst: int, rows: list[int]) -> None:
        self.compactions.append((dst, list(rows)))
        self.kv[dst : dst + len(rows)] = self.kv[rows]


class ScriptedDrafter(Drafter):
    """Step s drafts tree `script[s]`: a list of (parent window node, right?) in window order; then nothing."""

    name = "scripted"

    def __init__(self, script: list[list[tuple[int, bool]]], needs_hidden: bool = False, q_mix: float | None = None):
        self.script, self.needs_hidden, self.q_mix = list(script), needs_hidden, q_mix
        self.limits: list[tuple[int, int]] = []
        self.observed: list[list[int]] = []

    def propose(self, tokens, max_nodes, max_depth, sampling, rng) -> Proposal:
        self.limits.append((max_nodes, max_depth))
        if not self.script:
            return Proposal()
        nodes = self.script.pop(0)
        parents, drafted = [-1, *(parent for parent, _ in nodes)], [tokens[-1]]
        for w, (_, right) in enumerate(nodes, start=1):
            best = model(tokens[:-1] + [drafted[j] for j in ancestry(parents, parents[w])])
            drafted.append(best if right else (best + 1) % V)
        q = None
        if self.q_mix is not None:  # a stochastic drafter: q = mix · one-hot(x) + (1 − mix) · uniform
            q = np.full((len(nodes), V), (1 - self.q_mix) / V, np.float32)
            q[np.arange(len(nodes)), drafted[1:]] += self.q_mix
        return Proposal(drafted[1:], parents[1:], q)

    def observe(self, tokens, state=None) -> None:
        self.observed.append(list(tokens))


def expected_path(nodes: list[tuple[int, bool]]) -> list[int]:
    """The accepted window nodes of a scripted tree: from the root, the first right child, repeatedly."""
    node, path = 0, []
    while (nxt := next((w for w, (parent, right) in enumerate(nodes, 1) if parent == node and right), None)) is not None:
        path.append(nxt)
        node = nxt
    return path


def make(script, max_new_tokens=40, capacity=64, eos=(), sampling=None, **drafter):
    target = FakeTarget(capacity)
    d = ScriptedDrafter(script, **drafter)
    state = TargetState.allocate(capacity + 1, H, None)
    seq = Sequence(Request(PROMPT, max_new_tokens, sampling), SequenceTerms(capacity, frozenset(eos)), d, state,
                   target.compact)
    return seq, target, d


def run_all(seq: Sequence, target: FakeTarget) -> list[list[int]]:
    chunks = [seq.prefill(target.run)]
    while (new := seq.step(target.run)) is not None:
        chunks.append(new)
    return chunks


# one step each: a right chain, a chain wrong at depth 2, a tree whose right path is its 2nd branch,
# a tree right at every node, a wrong first draft, and (script exhausted) plain steps
SCRIPT = [
    [(0, RIGHT), (1, RIGHT), (2, RIGHT)],
    [(0, RIGHT), (1, WRONG), (2, RIGHT)],
    [(0, WRONG), (0, RIGHT), (2, RIGHT), (1, RIGHT)],
    [(0, RIGHT), (0, RIGHT), (1, RIGHT), (3, RIGHT)],
    [(0, WRONG)],
]


def test_each_step_commits_the_accepted_path_and_the_bonus_token():
    seq, target, drafter = make(SCRIPT, max_new_tokens=20)
    chunks = run_all(seq, target)
    plain = plain_greedy(PROMPT, 20)
    assert sum(chunks, []) == plain and seq.finish == "length"  # greedy output = plain greedy
    assert chunks[0] == plain[:1]  # prefill: the first token
    done = 1
    for s, nodes in enumerate(SCRIPT):
        accepted = len(expected_path(nodes))
        assert chunks[1 + s] == plain[done : done + accepted + 1], s  # the accepted drafts, then the bonus
        done += accepted + 1
    assert all(len(c) == 1 for c in chunks[1 + len(SCRIPT):])  # no draft: one token per pass
    paths = [expected_path(nodes) for nodes in SCRIPT]
    st = seq.result().stats
    assert st.steps == len(chunks) - 1 and st.drafted == sum(len(nodes) for nodes in SCRIPT)
    assert st.accepted == sum(len(p) for p in paths)
    assert st.accepted_per_position == [sum(len(p) > i for p in paths) for i in range(max(map(len, paths)))]
    assert drafter.observed[-1] == PROMPT + plain  # the drafter saw every commit


def test_rollback_moves_past_len_and_compaction_moves_only_off_path_rows():
    seq, target, _ = make(SCRIPT, max_new_tokens=20)
    run_all(seq, target)
    steps = target.passes[1:]  # after the prefill pass
    want_compactions = []
    for s, p in enumerate(steps[: len(SCRIPT)]):
        path = expected_path(SCRIPT[s])
        assert steps[s + 1].past == p.past + len(path) + 1  # rollback: the next root sits right after the path
        if path != list(range(1, len(path) + 1)):  # off the window's front: moved there
            want_compactions.append((p.past + 1, [p.past + w for w in path]))
    assert target.compactions == want_compactions and len(want_compactions) == 2  # SCRIPT's two off-front paths
    committed = PROMPT + seq.out
    assert target.kv[: len(committed) - 1].tolist() == committed[:-1]  # the cache holds exactly what was committed


def test_accepted_nodes_target_states_are_written_for_a_drafter_that_reads_them():
    seq, target, _ = make(SCRIPT, max_new_tokens=20, needs_hidden=True)
    run_all(seq, target)
    committed = PROMPT + seq.out
    n = len(committed) - 1  # the last token's state comes with the next pass
    np.testing.assert_array_equal(seq.state.hidden[:n, 0], np.asarray(committed[:-1], np.float32))


def test_max_new_tokens_limits_the_draft_depth_and_ends_with_length():
    long_chain = [[(w, RIGHT) for w in range(6)]] * 3  # 6 right drafts per step
    for n in (1, 2, 5, 9):
        seq, target, drafter = make(long_chain, max_new_tokens=n)
        chunks = run_all(seq, target)
        assert sum(chunks, []) == plain_greedy(PROMPT, n) and seq.result().finish_reason == "length"
        done = 1
        for max_nodes, max_depth in drafter.limits:  # every draft leaves room for the bonus token
            assert max_depth == n - done - 1 and max_nodes == 64 - len(PROMPT) - done
            done += min(6, max_depth) + 1


def test_kv_capacity_ends_generation_with_length():
    capacity = 12
    seq, target, drafter = make([[(w, RIGHT) for w in range(4)]] * 10, max_new_tokens=100, capacity=capacity)
    chunks = run_all(seq, target)
    out = sum(chunks, [])
    assert len(out) == capacity + 1 - len(PROMPT) and out == plain_greedy(PROMPT, len(out))  # every row, then one token
    assert seq.finish == "length" and max(p.past + len(p.window) for p in target.passes) <= capacity
    done = len(chunks[0])
    for (max_nodes, _), chunk in zip(drafter.limits, chunks[1:], strict=True):  # a draft fits the rows left
        assert max_nodes == capacity - len(PROMPT) - done
        done += len(chunk)


@pytest.mark.parametrize("at", [0, 2, 5])
def test_eos_stops_generation_even_inside_an_accepted_draft(at):
    plain = plain_greedy(PROMPT, 20)
    eos = plain[at]
    seq, target, _ = make([[(w, RIGHT) for w in range(4)]] * 5, eos={eos})
    out = sum(run_all(seq, target), [])
    assert seq.result().finish_reason == "stop" and out == plain[: plain.index(eos) + 1]


@pytest.mark.parametrize("q_mix", [None, 0.5])
def test_rejection_sampling_accepts_what_the_target_would_draw_and_resamples_the_rest(q_mix):
    """Temperature 1 over scaled one-hot logits: p is (numerically) one-hot at model(context). A right
    draft x has p(x) = 1 ≥ q(x): accepted. A wrong one has p(x) = 0: rejected, and the residual
    norm(max(0, p − q)) keeps only the target's token. So the output is the greedy one, whatever u."""
    seq, target, _ = make(SCRIPT, max_new_tokens=20, sampling=SamplingParams(temperature=1.0, seed=3), q_mix=q_mix)
    assert seq.rule_name == "rejection"
    out = sum(run_all(seq, target), [])
    assert out == plain_greedy(PROMPT, 20)
    assert seq.stats.accepted == sum(len(expected_path(nodes)) for nodes in SCRIPT)


class _Depths:
    """A stand-in adaptive controller choosing scripted depths; records what it was told."""

    def __init__(self, depths):
        self.depths, self.updates = list(depths), []

    def choose(self):
        return SimpleNamespace(depth=self.depths.pop(0) if self.depths else 3)

    def update(self, depth, node_depths, accepted, propose_s, verify_s):
        self.updates.append((depth, accepted))


def test_adaptive_depth_zero_is_a_plain_step():
    control = _Depths([0, 2, 0])
    target, drafter = FakeTarget(64), ScriptedDrafter([[(w, RIGHT) for w in range(4)]] * 4)
    seq = Sequence(Request(PROMPT, 12), SequenceTerms(64), drafter, TargetState.allocate(65, H, None), target.compact,
                   control)
    chunks = run_all(seq, target)
    assert sum(chunks, []) == plain_greedy(PROMPT, 12)
    assert [len(c) for c in chunks[1:4]] == [1, 3, 1]  # depth 0: no draft; depth 2: 2 drafts + bonus
    assert [d for _, d in drafter.limits[:2]] == [2, 3]  # the drafter is not asked at depth 0
    assert control.updates[:3] == [(0, 0), (2, 2), (0, 0)]
    st = seq.stats
    assert st.plain_steps == sum(d == 0 for d, _ in control.updates)
    assert st.depth_sum == sum(d for d, _ in control.updates)


def test_the_common_prefix_of_two_token_lists_is_the_first_difference():
    """What a feature layer keeps after a step (FeatureLayer.sync): the tokens two lists share from the start,
    found by comparing slices and halving; the same as walking them one by one, for every place the first
    difference can be and for either list the longer."""
    from specrt.runtime.drafters.features import common_prefix

    def walk(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    rng = np.random.default_rng(3)
    for _ in range(300):
        a = rng.integers(0, 3, int(rng.integers(0, 40))).tolist()
        b = a[: int(rng.integers(0, len(a) + 1))] + rng.integers(0, 3, int(rng.integers(0, 10))).tolist()
        for x, y in ((a, b), (b, a)):
            assert common_prefix(x, y) == walk(x, y), (x, y)
    assert common_prefix([], [1]) == 0 and common_prefix([1, 2], [1, 2]) == 2 and common_prefix([5], [6]) == 0


@pytest.mark.parametrize("parents,rows", [([-1], [0]), ([-1, 0, 1], [0, 1, 2]), ([-1, 0, 0, 1, 2], [0, 1, 2, 3, 4]),
                                          ([-1, 0, 0, 1], [3])])
def test_one_window_packs_as_a_batch_of_one(parents, rows):
    from specrt.runtime.sequence import pack_one, pack_windows
    from specrt.runtime.tree import Tree

    p = Pass(np.arange(7, 7 + len(parents), dtype=np.int64), 41, Tree.from_parents(parents), np.asarray(rows))
    one, batch = pack_one(p), pack_windows([p])
    assert len(one) == len(batch) == 5
    for a, b in zip(one, batch, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)
