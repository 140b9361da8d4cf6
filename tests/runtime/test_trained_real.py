"""Training, export and decoding of every learned drafter kind on the real model, end to end.

Each kind is trained briefly (seconds) on the target's answers to a few prompts, exported next to
the target, and run. On the prompts it was trained on, a drafter that learned anything must be
accepted (τ well above 1) — this checks the whole chain: the data rows, the label shifts, the
unrolled training steps, the graphs and the run-time feature plumbing agree with each other.
Sampling with the trained drafters must follow the target exactly (chi-square), and greedy output
must equal plain decoding. Quality on unseen prompts is measured by `specrt bench` (README).
"""

from __future__ import annotations

import pytest

from specrt.runtime.generate import Generator
from specrt.tools.validate import lossless_check

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(trained_drafters, trained_int4_bundle):
    """The default configuration: the int4 target on the native kernels (fp32 targets: test_lossless_every_drafter)."""
    _, prompts, metrics = trained_drafters
    return trained_int4_bundle, prompts, metrics


def test_training_reports_a_curve_and_saves_checkpoints(trained):
    _, _, metrics = trained
    for kind, m in metrics.items():
        assert m["steps_done"] > 0 and m["curve"], kind
        assert 0.0 <= min(m["final"]["top1_per_step"]) <= max(m["final"]["top1_per_step"]) <= 1.0
        seen = [c["tokens_seen"] for c in m["curve"]]
        assert 0 < seen[0] and seen == sorted(seen), kind
        epochs = m["final"]["epochs"]
        if float(epochs).is_integer():  # whole epochs: every training position seen that many times
            assert seen[-1] == int(epochs) * m["train_tokens"], kind


# measured with these settings: medusa ≥ 1.4, eagle/eagle2/eagle3/mtp ≥ 1.6; the draft model learns
# too slowly for a seconds-long run (τ ≈ 1.04), so it is held to losslessness only
@pytest.mark.parametrize("drafter,min_tau", [("medusa", 1.3), ("eagle", 1.4), ("eagle2", 1.4), ("eagle3", 1.4),
                                             ("mtp", 1.4), ("block", 1.4), ("draft", None)])
def test_trained_drafters_are_accepted_and_lossless(trained, drafter, min_tau):
    bundle, prompts, _ = trained
    # the τ bounds were measured with EAGLE-2's tree (10 nodes, beam 4), not the chain this machine's
    # costs would size (runtime/shapes.py)
    tree = {"tree_nodes": 10, "beam": 4} if drafter in ("eagle2", "eagle3") else {}
    gen = Generator(bundle, "plain", num_draft_tokens=4, max_seq_len=512, **tree)
    ids = [gen.tokenizer.encode_prompt(r["prompt"]) for r in prompts]
    plain = [gen.generate_ids(p, 40).token_ids for p in ids]
    gen.use(drafter)
    accepted = steps = 0
    for p, want in zip(ids, plain, strict=True):
        res = gen.generate_ids(p, 40)
        assert res.token_ids == want, drafter
        accepted, steps = accepted + res.stats.accepted, steps + res.stats.steps
    tau = (accepted + steps) / steps
    if min_tau is not None:
        assert tau >= min_tau, (drafter, tau)


@pytest.mark.parametrize("drafter,tree", [("eagle", "default"), ("medusa", "binary"), ("mtp", None),
                                          ("eagle3", "default"), ("block", None), ("eagle3-suffix", None)])
def test_sampling_with_trained_drafters_follows_the_target(trained, drafter, tree):
    bundle, _, _ = trained
    result, detail = lossless_check(bundle, drafter, tree, samples=300, length=3, top_k=4, progress=False)
    # These briefly trained drafters are rarely accepted on the first tokens under top-k 4 sampling, so
    # the check mostly exercises rejection and the residual draw against each kind's q (EAGLE-3's
    # q lives on its reduced vocabulary); acceptance itself is checked greedily above and by the
    # toy-model statistical tests (tests/runtime/test_distribution.py).
    assert detail["verify_steps"] > 0, detail
    assert result.verdict == "pass", (result.to_dict(), detail)
