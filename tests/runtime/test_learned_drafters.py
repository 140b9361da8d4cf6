"""Learned drafters at run time, on a tiny random target with real-size vocabulary:

- what each runtime drafter proposes equals an independent PyTorch recomputation from scratch
  (so the incremental KV caches, feature rows and step recurrences are right), before and after
  the committed sequence grows;
- greedy output equals plain decoding for every drafter and tree.
Random drafters are (almost) never accepted, so sampling and acceptance are tested with drafters
trained on the real model (tests/runtime/test_trained_real.py); how good they get is `specrt bench`'s job.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specrt.export import drafters
from specrt.export.bundle import truncated_draft
from specrt.export.modeling import rope_cos_sin
from specrt.runtime.generate import Generator
from specrt.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def learned(random_drafters_bundle):
    """(bundle, target LoadedModel, torch drafter modules) with random drafters of every kind."""
    bundle, target, requested = random_drafters_bundle
    modules = {kind: drafters.load(path, target.module) for kind, path in requested}
    return bundle, target, modules


def target_states(target, tokens: list[int], taps=()):
    """The target's hidden states (and tapped layer inputs) for `tokens`, by PyTorch."""
    t = len(tokens)
    out = target.module(torch.tensor([tokens]), torch.arange(t)[None], torch.tensor([0]),
                        torch.tril(torch.ones(t, t, dtype=torch.bool))[None], target.module.new_kv(1, t + 1), taps=taps)
    return out[1][0], (out[2][0] if taps else None)


def rows_from_scratch(module, ids: list[int], feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One causal pass over rows 0..n-1 from an empty cache: (logits, outputs)."""
    n = len(ids)
    with torch.no_grad():
        logits, out = module.step(torch.tensor([ids]), feats[None], torch.arange(n)[None], torch.tensor([0]),
                                  torch.tril(torch.ones(n, n, dtype=torch.bool))[None], module.new_kv(1, n + 1))
    return logits[0], out[0]


def reference_chain(kind: str, module, target, tokens: list[int], steps: int) -> list[int]:
    """The greedy chain each kind drafts, recomputed from scratch in PyTorch, as target ids (a head over a
    draft vocabulary maps its argmax through `head_vocab`, and the next step reads that target id)."""
    m = len(tokens) - 1
    vocab = getattr(module, "head_vocab", None)
    target_id = (lambda i: int(i)) if vocab is None else (lambda i: int(vocab[int(i)]))  # noqa: E731
    if kind == "draft":  # greedy decoding with the draft model, one full pass per token
        ids = list(tokens)
        for _ in range(steps):
            t = len(ids)
            with torch.no_grad():
                logits = module(torch.tensor([ids]), torch.arange(t)[None], torch.tensor([0]),
                                torch.tril(torch.ones(t, t, dtype=torch.bool))[None], module.new_kv(1, t + 1))[0]
            ids.append(int(logits[0, -1].argmax()))
        return ids[len(tokens):]
    if kind == "medusa":
        hidden, _ = target_states(target, tokens[:-1])
        with torch.no_grad():
            return [target_id(i) for i in module(hidden[m - 1])[:steps].argmax(-1)]
    taps = tuple(module.cfg.taps) if kind in ("eagle3", "block") else ()
    hidden, aux = target_states(target, tokens[:-1], taps)
    if kind == "block":  # one causal pass: the committed rows, then steps-1 mask rows (id -1)
        with torch.no_grad():
            feats = torch.cat([module.fuse(aux), torch.zeros(steps - 1, aux.shape[1] // len(taps))])
        logits, _ = rows_from_scratch(module, [*tokens[1:], *[-1] * (steps - 1)], feats)
        return module.target_ids()[logits[m - 1 :].argmax(-1)].tolist()
    if kind in ("eagle", "eagle3"):
        with torch.no_grad():
            feats = module.fuse(aux) if kind == "eagle3" else hidden
        ids, drafts = tokens[1:], []
        for _ in range(steps):  # each drafted row reads the previous row's own output
            logits, out = rows_from_scratch(module, ids, feats)
            tok = int(logits[-1].argmax())
            tok = int(module.target_ids()[tok]) if kind == "eagle3" else target_id(tok)
            drafts.append(tok)
            ids, feats = [*ids, tok], torch.cat([feats, out[-1:]])
        return drafts
    # mtp: step k runs module k over rows 0..m+k-1, reading step k-1's output of the previous row
    drafts, prev = [], hidden  # step 0 reads the target's h[r]
    for k in range(steps):
        mod = module.mtp[module.cfg.module_for(k)]
        ids = [*tokens[1:], *drafts]
        feats = prev if k == 0 else torch.cat([torch.zeros_like(prev[:1]), prev])  # row r reads row r-1
        logits, out = rows_from_scratch(mod, ids, feats[: len(ids)])
        drafts.append(target_id(logits[-1].argmax()))
        prev = out
    return drafts


def propose(gen: Generator, tokens: list[int], steps: int) -> list[int]:
    """Drive the runtime drafter as the generator does (prefill fills the target state), then propose."""
    outs = gen.forward(tokens[:-1], 0)
    gen.state.write(np.arange(len(tokens) - 1), outs, np.arange(len(tokens) - 1))
    gen.drafter.observe(tokens, gen.state)
    prop = gen.drafter.propose(tokens, 64, steps, SamplingParams(), np.random.default_rng(0))
    assert prop.parents == list(range(len(prop))), "a chain was asked for"
    return prop.tokens


@pytest.mark.covers("proposal")
@pytest.mark.parametrize("kind,runtime", [("draft", "draft"), ("medusa", "medusa"), ("eagle", "eagle"),
                                          ("eagle3", "eagle3"), ("mtp", "mtp"), ("block", "block")])
def test_runtime_proposals_equal_a_recomputation_from_scratch(learned, kind, runtime):
    bundle, target, modules = learned
    if kind == "draft":  # the bundle's draft model: the target's first layer (draft_layers=1)
        modules = {"draft": truncated_draft(target.module, 1)}
    gen = Generator(bundle, runtime, num_draft_tokens=3, max_seq_len=128, tree="chain", tree_nodes=3, beam=1)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 49152, 12).tolist()
    for grow in (0, 3, 1):  # the committed sequence grows: cached rows are reused, new ones fed
        tokens = tokens + rng.integers(0, 49152, grow).tolist()
        want = reference_chain(kind, modules[kind], target, tokens, 3)
        assert propose(gen, tokens, 3) == want, (kind, len(tokens))


@pytest.mark.parametrize("runtime,kind", [("eagle2", "eagle"), ("eagle3", "eagle3")])
def test_a_beam_of_one_drafts_the_greedy_chain_cut_to_its_node_budget(learned, runtime, kind):
    """Beam 1 takes the chain path (no ranking): what the dynamic tree keeps is its `tree_nodes` shallowest
    nodes, so 2 nodes of a depth-4 search are the greedy chain's first 2, and the full budget its 4."""
    bundle, target, modules = learned
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 49152, 14).tolist()
    for nodes, want in ((2, 2), (4, 4)):
        gen = Generator(bundle, runtime, num_draft_tokens=4, max_seq_len=128, tree="chain", tree_nodes=nodes, beam=1)
        assert propose(gen, tokens, 4) == reference_chain(kind, modules[kind], target, tokens, want), nodes


def test_a_chain_says_how_sure_its_head_is_only_when_asked(learned):
    """`keep_confidence` (scripts/draft_confidence.py) leaves the drafts as they are and gives each one the product
    of the chain's top-1 draft probabilities down to it: within (0, 1], never rising with depth."""
    from specrt.runtime.drafters.eagle import top_probability

    bundle, _, _ = learned
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 49152, 14).tolist()
    gen = Generator(bundle, "eagle3", num_draft_tokens=4, max_seq_len=128, tree="chain", tree_nodes=4, beam=1)
    plain = propose(gen, tokens, 4)
    assert gen.drafter.propose(tokens, 64, 4, SamplingParams(), np.random.default_rng(0)).confidence is None
    gen.drafter.keep_confidence = True
    prop = gen.drafter.propose(tokens, 64, 4, SamplingParams(), np.random.default_rng(0))
    assert prop.tokens == plain
    assert len(prop.confidence) == 4
    assert all(0 < c <= 1 for c in prop.confidence)
    assert all(b <= a for a, b in zip(prop.confidence, prop.confidence[1:], strict=False))
    logits = rng.normal(0, 3, 4096).astype(np.float32)
    best = int(logits.argmax())
    assert top_probability(logits, best) == pytest.approx(float(torch.softmax(torch.from_numpy(logits).double(), 0)[best]),
                                                          rel=1e-12)


RUNTIME_CASES = [("draft", None), ("medusa", None), ("medusa", "binary"), ("eagle", None), ("eagle", "default"), ("eagle2", None),
                 ("eagle3", None), ("mtp", None), ("block", None), ("block", "chain")]


def test_greedy_output_equals_plain_for_every_learned_drafter(learned):
    bundle, _, _ = learned
    gen = Generator(bundle, "plain", num_draft_tokens=4, max_seq_len=160)
    prompts = [gen.tokenizer.encode_prompt(p) for p in ("Name three rivers.", "Write a haiku about rain.")]
    plain = [gen.generate_ids(p, 40).token_ids for p in prompts]
    for name, tree in RUNTIME_CASES:
        gen.use(name, tree)
        for p, want in zip([*prompts, prompts[0]], [*plain, plain[0]], strict=True):  # a prompt again: caches
            # from the previous run must be reused or dropped correctly
            res = gen.generate_ids(p, 40)
            assert res.token_ids == want, (name, tree)
            assert res.stats.drafted > 0, (name, tree)  # it did draft


def test_a_bundle_without_the_drafter_says_how_to_export_it(real_bundle):
    from specrt.errors import SpecrtError

    with pytest.raises(SpecrtError, match="export --drafter eagle"):
        Generator(real_bundle, "eagle")


def test_training_rope_positions_match_the_runtime():
    """Drafted rows use position m-1+depth; training uses the row index: the same numbers."""
    from specrt.schema.config import DecoderConfig

    cfg = DecoderConfig("llama", 8, 8, 8, 1, 1, 1, 8, 1e-6, (1.0, 0.1, 0.01, 0.001))
    cos, _ = rope_cos_sin(cfg, torch.arange(6)[None])
    cos2, _ = rope_cos_sin(cfg, torch.tensor([[5]]))
    torch.testing.assert_close(cos[..., 5:6, :], cos2)
