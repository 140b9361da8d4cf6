"""Learned drafter modules: ONNX graphs match PyTorch, training attention matches inference,
checkpoints round-trip, and bad checkpoints fail clearly."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from specrt import kinds
from specrt.errors import SpecrtError
from specrt.export import drafters
from specrt.export.bundle import parity
from specrt.export.decoder_graph import build_decoder_graph
from specrt.export.drafter_export import export_drafter, feature_parity
from specrt.export.drafters.eagle3 import fuse_graph
from specrt.export.drafters.graphs import feature_graph
from specrt.export.drafters.medusa import medusa_graph
from specrt.export.loading import module_from_hf
from specrt.export.modeling import rope_cos_sin
from specrt.export.training.objectives import top1_hits, top_hits, ttt_mask
from specrt.kinds import learned_kinds
from tests.helpers import tiny_hf_model

FEATURE_KINDS = [("eagle", {}), ("eagle", {"input_norm": True, "fc_bias": False}),
                 ("eagle3", {"taps": [0, 1], "draft_vocab_size": 40}), ("mtp", {"num_modules": 2})]


@pytest.fixture(scope="module")
def target():
    return module_from_hf(tiny_hf_model("llama", seed=3))


def randomized(module, seed=0):
    """Random non-trivial weights everywhere the drafter owns (zero-initialised blocks included)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.requires_grad:
                base = 1.0 if name.endswith("norm.weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
    return module.eval()


def feature_modules(module):
    return list(module.mtp) if module.cfg.kind == "mtp" else [module]


@pytest.mark.covers("export")
@pytest.mark.parametrize("kind", learned_kinds())
def test_every_kind_exports_graphs_that_match_pytorch(tmp_path, target, kind):
    """Each kind's own graph writer (its spec), with its parity checks, on random weights."""
    spec = kinds.kind(kind)
    module = randomized(drafters.build(drafters.make_config(kind, **spec.example_config), target))
    if spec.bundle_role:  # exported as a decoder role of the bundle (the draft model)
        path = tmp_path / f"{kind}.onnx"
        onnx.save(build_decoder_graph(module.lm, spec.bundle_role), path)
        worst = parity(module.lm, path)
    else:
        graphs, entry = export_drafter(module, tmp_path, target.cfg, "test", check_parity=True)
        assert set(entry["parity_max_abs"]) == set(graphs)  # every graph written was checked
        worst = entry["parity_max_abs"]
    assert worst and max(worst.values()) < 1e-4, worst


@pytest.mark.parametrize("kind,fields", FEATURE_KINDS)
def test_feature_graph_matches_pytorch(tmp_path, target, kind, fields):
    module = randomized(drafters.build(drafters.make_config(kind, **fields), target))
    for i, m in enumerate(feature_modules(module)):
        path = tmp_path / f"{kind}{i}.onnx"
        onnx.save(feature_graph(m, f"{kind}{i}"), path)
        assert feature_parity(m, path) < 1e-4  # prefill rows, then a 3-node tree, logits and features
        graph = onnx.load(str(path)).graph
        # the embedding is the target's, gathered by the runtime from the target's own table: never a copy
        assert "inputs_embeds" in {i.name for i in graph.input}
        assert not [t.name for t in graph.initializer if "embed_tokens" in t.name]


@pytest.mark.parametrize("own_heads", [False, True])
def test_medusa_graph_matches_pytorch(tmp_path, target, own_heads):
    module = randomized(drafters.build(drafters.make_config("medusa", num_heads=3, num_layers=2,
                                                           own_heads=own_heads), target))
    path = tmp_path / "medusa.onnx"
    onnx.save(medusa_graph(module), path)
    hidden = torch.randn(2, 3, 64)
    got = ort.InferenceSession(str(path)).run(None, {"hidden_in": hidden.numpy()})[0]
    with torch.no_grad():
        want = module(hidden).numpy()
    assert got.shape == (2, 3, 3, 128)
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_eagle3_fuse_graph_matches_pytorch(tmp_path, target):
    module = randomized(drafters.build(drafters.make_config("eagle3", taps=[0, 1]), target))
    path = tmp_path / "fuse.onnx"
    onnx.save(fuse_graph(module), path)
    aux = torch.randn(1, 4, 128)
    got = ort.InferenceSession(str(path)).run(None, {"aux_hidden_states": aux.numpy()})[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, module.fuse(aux).numpy(), atol=1e-5)


@pytest.mark.parametrize("kind,fields", FEATURE_KINDS)
def test_training_attention_equals_inference(target, kind, fields):
    """With a causal mask and no extra keys, the training path is the inference path."""
    module = randomized(drafters.build(drafters.make_config(kind, **fields), target))
    m = feature_modules(module)[0]
    ids, hidden = torch.randint(0, 128, (2, 7)), torch.randn(2, 7, 64)
    causal = torch.tril(torch.ones(7, 7, dtype=torch.bool))
    cos, sin = rope_cos_sin(m.dec, torch.arange(7)[None])
    with torch.no_grad():
        out, _ = m.layer_train(ids, hidden, cos, sin, [], causal)
        _, want = m.step(ids, hidden, torch.arange(7)[None].expand(2, -1), torch.tensor([0, 0]),
                         causal[None].expand(2, -1, -1), m.new_kv(2, 8))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_training_time_test_mask_matches_drafting():
    """Step s, row r sees real rows ≤ r-s+1 and the chain it extends (step j at row r-(s-j))."""
    m = ttt_mask(5, 3)  # 5 rows, step 3: columns = [real 5 | step-2 5 | step-3 5]
    assert m.shape == (5, 15)
    r = 4
    assert m[r, :5].tolist() == [True, True, True, False, False]  # real rows 0..2
    assert m[r, 5:10].tolist() == [False, False, False, True, False]  # step 2 at row 3
    assert m[r, 10:].tolist() == [False, False, False, False, True]  # itself
    assert ttt_mask(4, 1).equal(torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_top_k_hits_count_the_targets_token_among_the_drafters_best():
    """Row by row: the target's token at rank 1, 2, 4, beyond 4, and a masked row (never counted)."""
    logits = torch.tensor([[[9.0, 5, 3, 2, 1, 0], [5, 9, 3, 2, 1, 0], [9, 5, 3, 2, 1, 0],
                            [9, 5, 3, 2, 1, 0], [9, 5, 3, 2, 1, 0]]])
    top = torch.tensor([[0, 0, 3, 5, 0]])
    mask = torch.tensor([[True, True, True, True, False]])
    assert top_hits(logits, top, mask) == (1, 4, (1, 2, 2, 3))
    assert top_hits(logits, top, mask)[:2] == top1_hits(logits, top, mask)


def test_unrolled_step_equals_a_drafted_row(target):
    """A step-2 training row computes what the runtime computes for the first drafted row: real rows
    0..r-1 in the cache, then the row reading (x[r+1], the layer's own output of row r-1)."""
    module = randomized(drafters.build(drafters.make_config("eagle"), target))
    ids, real = torch.randint(0, 128, (1, 6)), torch.randn(1, 6, 64)
    cos, sin = rope_cos_sin(module.dec, torch.arange(6)[None])
    with torch.no_grad():
        out1, kv1 = module.layer_train(ids, real, cos, sin, [], ttt_mask(6, 1))
        shifted = torch.cat([torch.zeros_like(out1[:, :1]), out1[:, :-1]], 1)
        out2, _ = module.layer_train(ids, shifted, cos, sin, [kv1], ttt_mask(6, 2))
        r = 4  # runtime: committed rows 0..3, drafted row 4 reads out1[3]
        kv = module.new_kv(1, 8)
        module.step(ids[:, :r], real[:, :r], torch.arange(r)[None], torch.tensor([0]),
                    torch.tril(torch.ones(r, r, dtype=torch.bool))[None], kv)
        _, drafted = module.step(ids[:, r : r + 1], out1[:, r - 1 : r], torch.tensor([[r]]), torch.tensor([r]),
                                 torch.ones(1, 1, 1, dtype=torch.bool), kv)
    torch.testing.assert_close(out2[0, r], drafted[0, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind,fields", [*FEATURE_KINDS, ("medusa", {"num_heads": 2}), ("draft", {"num_layers": 1})])
def test_checkpoint_round_trip(tmp_path, target, kind, fields):
    module = randomized(drafters.build(drafters.make_config(kind, **fields), target))
    drafters.save(module, tmp_path / "ck")
    assert not list(tmp_path.glob(".ck.partial*"))
    loaded = drafters.load(tmp_path / "ck", target)
    for k, v in module.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, atol=0, rtol=0, msg=k)
    from safetensors.torch import load_file

    stored = set(load_file(tmp_path / "ck" / "model.safetensors"))
    shared = ("embed_tokens.weight", "lm_head.weight") if module.shares_head else ("embed_tokens.weight",)
    assert not [k for k in stored if k.endswith(shared)]  # the target's weights are never copied
    assert stored == set(module.trainable_state())


def test_checkpoint_for_another_target_is_refused(tmp_path, target):
    module = drafters.build(drafters.make_config("eagle"), target)
    drafters.save(module, tmp_path / "ck")
    other = module_from_hf(tiny_hf_model("llama", hidden_size=32, num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(SpecrtError, match="hidden_size 64.*target has 32"):
        drafters.load(tmp_path / "ck", other)


def test_missing_or_bad_checkpoint_files_fail_clearly(tmp_path, target):
    with pytest.raises(SpecrtError, match="config.json is missing"):
        drafters.load(tmp_path, target)
    module = drafters.build(drafters.make_config("medusa"), target)
    drafters.save(module, tmp_path / "ck")
    (tmp_path / "ck" / "model.safetensors").unlink()
    with pytest.raises(SpecrtError, match="model.safetensors is missing"):
        drafters.load(tmp_path / "ck", target)
    with pytest.raises(SpecrtError, match="has no setting bogus"):
        drafters.make_config("medusa", bogus=1)
    with pytest.raises(SpecrtError, match="unknown drafter kind"):
        drafters.make_config("lookahead")


def test_an_eagle3_head_from_the_target_is_sliced_not_stored(tmp_path, target):
    from safetensors.torch import load_file

    from specrt.export.drafters.eagle3 import eagle3_warm_start

    vocab = torch.tensor([3, 7, 11, 40, 90])
    module = drafters.build(drafters.make_config("eagle3", taps=[0, 1], draft_vocab_size=5, head_from_target=True),
                            target)
    eagle3_warm_start(module, target, vocab)
    randomized(module)  # the head is frozen: it keeps the target's rows
    torch.testing.assert_close(module.lm_head.weight, target.lm_head.weight[vocab], atol=0, rtol=0)
    drafters.save(module, tmp_path / "ck", "fp16")
    stored = load_file(tmp_path / "ck" / "model.safetensors")
    assert "lm_head.weight" not in stored and stored["d2t"].dtype == torch.int64
    assert all(v.dtype == torch.float16 for k, v in stored.items() if k != "d2t")  # half the size
    loaded = drafters.load(tmp_path / "ck", target)
    torch.testing.assert_close(loaded.lm_head.weight, target.lm_head.weight[vocab], atol=0, rtol=0)
    for k, v in module.trainable_state().items():  # fp16 storage: within its rounding
        torch.testing.assert_close(loaded.state_dict()[k].float(), v.float(), atol=1e-3, rtol=2**-10, msg=k)
    with pytest.raises(SpecrtError, match="checkpoint dtype"):
        drafters.save(module, tmp_path / "bad", "int8")


HEAD_VOCAB_KINDS = [(k.name, {**k.example_config, **({"own_heads": own} if k.name == "medusa" else {})})
                    for k in kinds.kinds().values() if k.training and k.training.head_vocab
                    for own in ((False, True) if k.name == "medusa" else (None,))]


@pytest.mark.parametrize("kind,fields", HEAD_VOCAB_KINDS)
def test_a_head_vocabulary_round_trips_and_exports_only_its_rows(tmp_path, target, kind, fields):
    """A head over a draft vocabulary (EAGLE, MTP, Medusa): the checkpoint keeps the ids, the graph
    computes only their rows (each logit the full head's logit of that target id) and the manifest entry
    names vocab_ids.npy, which maps draft ids back to those target ids."""
    from safetensors.torch import load_file

    vocab = torch.tensor([2, 5, 17, 40, 41, 99, 127])
    module = randomized(drafters.build(drafters.make_config(kind, **fields), target))
    hidden = torch.randn(1, 3, target.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    ids, pos, past = torch.tensor([[4, 9, 30]]), torch.arange(3)[None], torch.tensor([0])
    mask = torch.tril(torch.ones(3, 3, dtype=torch.bool))[None]

    def logits(m):
        if kind == "medusa":
            return m(hidden)
        first = feature_modules(m)[0]
        return first.step(ids, hidden, pos, past, mask, first.new_kv(1, 4))[0]

    full = logits(module)
    module.set_head_vocab(vocab)
    sliced = logits(module)  # the same sums; a GEMM over fewer rows may order them otherwise
    torch.testing.assert_close(sliced, full[..., vocab], atol=1e-5, rtol=1e-5)

    drafters.save(module, tmp_path / "ck")
    assert torch.equal(load_file(tmp_path / "ck" / "model.safetensors")["head_vocab"], vocab)
    loaded = drafters.load(tmp_path / "ck", target)
    assert torch.equal(loaded.head_vocab, vocab)
    torch.testing.assert_close(logits(loaded), sliced, atol=0, rtol=0)

    graphs, entry = export_drafter(loaded, tmp_path / "out", target.cfg, "test", check_parity=True)
    assert max(entry["parity_max_abs"].values()) < 1e-4
    assert np.array_equal(np.load(tmp_path / "out" / entry["vocab_ids"]), vocab.numpy())
    for g in graphs.values():
        [out] = [o for o in onnx.load(str(tmp_path / "out" / g.file), load_external_data=False).graph.output
                 if o.name == "logits"]
        assert out.type.tensor_type.shape.dim[-1].dim_value == len(vocab)


@pytest.mark.parametrize("bad", [[5, 2, 9], [2, 2, 9], [3, 128], [-1, 4]])
def test_a_bad_head_vocabulary_is_refused(tmp_path, target, bad):
    module = drafters.build(drafters.make_config("eagle"), target)
    module.set_head_vocab(torch.tensor(bad))
    drafters.save(module, tmp_path / "ck")
    with pytest.raises(SpecrtError, match="head_vocab must list distinct target ids 0..127 in ascending order"):
        drafters.load(tmp_path / "ck", target)
