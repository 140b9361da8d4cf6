"""Learned drafters and draft training on targets of every accepted family compute what they export.

- A learned drafter's layer (EAGLE, EAGLE-3, MTP, block) is the drafter's own plain pre-norm SwiGLU
  layer with full attention, whatever the target's family: the torch module, its training passes and
  its ONNX graph agree, and a layer config carrying family maths is refused by the graph writer.
- The draft LM's training objective runs DecoderLM's own maths (windows, sandwich norms, softcaps,
  embedding scale): its logits are DecoderLM.forward's.
- On a tiny windowed Mistral and a tiny Gemma-2 (softcaps, sandwich norms, window < prompt), random
  drafters of every learned kind export with passing parity, and greedy speculative output through
  ONNX Runtime equals plain greedy output for every runtime drafter.
"""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from specrt import kinds
from specrt.errors import SpecrtError
from specrt.export import drafters
from specrt.export.bundle import ExportOptions, export_bundle
from specrt.export.drafter_export import PARITY_TOLERANCE, feature_parity
from specrt.export.drafters.base import FAMILY_FIELDS, KEPT_FIELDS
from specrt.export.drafters.graphs import feature_graph
from specrt.export.loading import LoadedModel, module_from_hf
from specrt.export.training.datagen import DistillData, generate
from specrt.export.training.objectives import Batch
from specrt.kinds import learned_kinds, resolve
from specrt.runtime.generate import Generator
from specrt.schema.config import DecoderConfig
from tests.export.test_families import prompt_ids
from tests.helpers import TINY, save_random_drafters, save_tiny_folder, save_word_tokenizer, tiny_hf_model

NEW_TOKENS = 16
WINDOW = 3  # shorter than every sequence below: the window hides keys
# family group -> (model_type, overrides): a windowed Mistral; a Gemma-2 with softcapped scores and logits,
# sandwich norms, query_pre_attn_scalar (tests/helpers.py FAMILY_OVERRIDES) and a sliding layer 0
FAMILIES = {"mistral-window": ("mistral", dict(sliding_window=WINDOW)),
            "gemma2-window": ("gemma2", dict(sliding_window=WINDOW))}
FEATURE_KINDS = [k for k in learned_kinds() if kinds.kind(k).graphs and k != "medusa"]  # one-layer drafters
RUNTIME = [name for k in learned_kinds() for name in kinds.kind(k).runtime]


def target_module(family: str, **extra):
    model_type, overrides = FAMILIES[family]
    return module_from_hf(tiny_hf_model(model_type, seed=1, **overrides, **extra))


def test_every_config_field_is_kept_or_reset_by_a_drafter_layer():
    """A new DecoderConfig field must be classified: kept from the target, or family maths reset."""
    names = [f.name for f in fields(DecoderConfig)]
    assert not set(KEPT_FIELDS) & set(FAMILY_FIELDS)
    assert sorted(KEPT_FIELDS + FAMILY_FIELDS) == sorted(names)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("kind", FEATURE_KINDS)
def test_drafter_layer_is_plain_whatever_the_family(family, kind):
    target = target_module(family)
    assert any(target.cfg.layer_windows)  # the target does carry family maths
    module = drafters.build(drafters.make_config(kind, **kinds.kind(kind).example_config), target)
    layers = list(module.mtp) if kind == "mtp" else [module]
    plain = DecoderConfig(**{**{f: getattr(target.cfg, f) for f in KEPT_FIELDS}, "num_layers": 1})
    for m in layers:
        assert m.dec == plain
        assert not any("feedforward_layernorm" in k for k in m.state_dict())  # no unused sandwich norms


def test_a_drafter_layer_carrying_family_maths_is_refused_by_the_graph_writer():
    target = target_module("gemma2-window")
    module = drafters.build(drafters.make_config("eagle"), target)
    module.dec = replace(module.dec, layer_windows=(WINDOW,))
    with pytest.raises(SpecrtError, match=r"layer_windows = \(3,\).*one_layer"):
        feature_graph(module, "eagle")


@pytest.mark.parametrize("kind", [k for k in learned_kinds() if kinds.kind(k).training.warm_start])
def test_warm_starts_take_a_sandwich_normed_target(kind):
    """Each kind's warm start loads from a Gemma-2 target's layers (sandwich norms: the norm before the MLP)."""
    target = target_module("gemma2-window")
    spec = kinds.kind(kind)
    module = drafters.build(drafters.make_config(kind, **spec.example_config), target)
    resolve(spec.training.warm_start)(module, target, torch.arange(40))
    if kind == "mtp":
        want = target.model.layers[-1].pre_feedforward_layernorm.weight
        torch.testing.assert_close(module.mtp[0].block.post_attention_layernorm.weight, want, rtol=0, atol=0)


def draft_batch(target, draft_layers: int):
    """(the draft kind's module, its objective, a batch of 2 right-padded sequences longer than WINDOW)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in (6, 9)]
    seqs = generate(target, prompts, 8, (0, 1), batch_size=2, progress=False)
    data = DistillData.from_sequences(seqs, [len(p) for p in prompts], [False, False], (0, 1))
    spec = kinds.kind("draft")
    module = drafters.build(drafters.make_config("draft", num_layers=draft_layers), target)
    vocab = torch.randperm(TINY["vocab_size"], generator=g)[:50]  # a label vocabulary, not in id order
    label_index = torch.full((TINY["vocab_size"],), -1, dtype=torch.long)
    label_index[vocab] = torch.arange(len(vocab))
    objective = resolve(spec.training.objective)(module, data, vocab)
    return module, objective, Batch(data, [0, 1], label_index), vocab


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_draft_objective_logits_are_the_modules_forward(family):
    """The objective's logits are DecoderLM.forward's (restricted to the label vocabulary) for the same
    tokens; a loop of plain pre-norm layers without windows, softcaps or embedding scale differs."""
    target = target_module(family, num_hidden_layers=3)  # a 2-layer draft: sliding and full layers
    module, objective, batch, vocab = draft_batch(target, 2)
    lm, (b, t) = module.lm, batch.tokens.shape
    assert t > 2 * WINDOW and any(lm.cfg.layer_windows)
    if family.startswith("gemma2"):  # a sliding and a full layer, and the rest of Gemma-2's maths
        assert not all(lm.cfg.layer_windows) and lm.cfg.embed_scale != 1.0 and lm.cfg.sandwich_norms
        assert lm.cfg.attn_logit_softcapping and lm.cfg.final_logit_softcapping
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(b, -1, -1)
    want = lm(batch.tokens, torch.arange(t).expand(b, -1), torch.zeros(b, dtype=torch.long), causal,
              lm.new_kv(b, t))[0][..., vocab]
    with torch.no_grad():
        got = objective.logits(batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # training differentiates that maths: every draft weight the forward uses gets a gradient
    loss, _ = objective(batch)
    loss.backward()
    no_grad = [n for n, p in module.lm.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    assert not no_grad, no_grad


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_bundle(request, tmp_path_factory):
    """(family, bundle, target LoadedModel, [(kind, checkpoint)]): a tiny target of the family exported with
    random drafters of every learned kind (the draft kind as the bundle's draft model)."""
    family = request.param
    model_type, overrides = FAMILIES[family]
    tmp = tmp_path_factory.mktemp(family)
    tokenizer = save_word_tokenizer(tmp / "tokenizer", TINY["vocab_size"])
    folder = save_tiny_folder(tmp / model_type, model_type, None, seed=1, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    target = LoadedModel(module=module_from_hf(hf), tokenizer=PreTrainedTokenizerFast.from_pretrained(tokenizer),
                         source=str(folder), hf_config=hf.config)
    specs = {k: dict(kinds.kind(k).example_config) for k in learned_kinds()}
    requested = save_random_drafters(tmp / "drafters", target, specs)
    export_bundle(target, tmp / "bundle", ExportOptions(progress=False, drafters=tuple(requested)))
    return family, tmp / "bundle", target, requested


def test_every_learned_kind_exports_with_checked_parity(family_bundle):
    from specrt.schema.manifest import Manifest

    family, bundle, target, requested = family_bundle
    manifest = Manifest.load(bundle)
    assert any(manifest.graphs["target"].config.layer_windows), family
    assert any(manifest.graphs["draft"].config.layer_windows), family  # the draft keeps the target's maths
    learned = {k for k in learned_kinds() if not kinds.kind(k).bundle_role}
    assert set(manifest.drafters) == learned
    for kind, entry in manifest.drafters.items():
        assert set(entry["parity_max_abs"]) == set(entry["graphs"]), kind  # every graph written was checked
        assert max(entry["parity_max_abs"].values()) < PARITY_TOLERANCE, (kind, entry["parity_max_abs"])
    assert max(manifest.artifacts["parity_max_abs_logits"]["draft"].values()) < PARITY_TOLERANCE
    # and that check compares: the same graph against a changed module fails it
    module = drafters.load(dict(requested)["eagle"], target.module)
    with torch.no_grad():
        module.layer.mlp.down_proj.weight.mul_(1.5)
    assert feature_parity(module, bundle / manifest.graphs["eagle"].file) > PARITY_TOLERANCE


@pytest.mark.parametrize("drafter", RUNTIME)
def test_greedy_speculation_equals_plain(family_bundle, drafter):
    family, bundle, _, _ = family_bundle
    prompt = prompt_ids()  # 12 tokens: past the window from the first step
    plain = Generator(bundle, "plain", max_seq_len=64).generate_ids(prompt, NEW_TOKENS).token_ids
    res = Generator(bundle, drafter, num_draft_tokens=3, max_seq_len=64).generate_ids(prompt, NEW_TOKENS)
    assert res.token_ids == plain, (family, drafter)
    assert res.stats.drafted > 0, (family, drafter)


class Fetches:
    """A store's interface over `data`, recording which fields training reads."""

    def __init__(self, data):
        self.data, self.names = data, set()

    def __getattr__(self, name):
        return getattr(self.data, name)

    def fetch(self, name, i):
        self.names.add(name)
        return self.data.fetch(name, i)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_training_reads_the_final_hidden_states_only_where_its_objective_uses_them(kind):
    """EAGLE-3 learns from the tapped layers (aux): reading the final hidden states too would stream a quarter
    more of a store's bytes from disk per step for nothing. EAGLE-1 feeds them to its layer."""
    target = module_from_hf(tiny_hf_model("llama", seed=1))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in (6, 9)]
    spec = kinds.kind(kind)
    module = drafters.build(drafters.make_config(kind, **spec.example_config), target)
    taps = tuple(getattr(module.cfg, "taps", ()) or (0, 1))
    data = DistillData.from_sequences(generate(target, prompts, 8, taps, batch_size=2, progress=False),
                                      [len(p) for p in prompts], [False, False], taps)
    n = module.lm_head.weight.shape[0]  # the draft vocabulary (EAGLE-3) or the whole one
    vocab = torch.arange(n)
    label_index = torch.full((TINY["vocab_size"],), -1, dtype=torch.long)
    label_index[vocab] = vocab
    objective = resolve(spec.training.objective)(module, data, vocab)
    seen = Fetches(data)
    loss, _ = objective(Batch(seen, [0, 1], label_index))
    assert torch.isfinite(loss)
    assert ("hidden" in seen.names) == (kind == "eagle"), seen.names
