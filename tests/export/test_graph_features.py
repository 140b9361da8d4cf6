"""Features from the deployed graph: a store's states recomputed by a bundle's own target graph keep the
store's answers and splits, equal the target's own states, and a rerun adds nothing."""

from __future__ import annotations

import json

import pytest
import torch

from specrt.errors import SpecrtError
from specrt.export.training.corpus import load_prompts
from specrt.export.training.distill import build_store
from specrt.export.training.graph_features import featurize_store, tapped_graph
from specrt.export.training.store import MappedData

TAPS = (2, 15, 27)


def store_prompts(train: int = 2) -> list[dict]:
    rows = load_prompts()
    return [r for r in rows if r["split"] == "heldout"][:1] + [r for r in rows if r["split"] == "train"][:train]


@pytest.fixture(scope="module")
def answer_store(real_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("answers") / "store"
    build_store(real_model, store_prompts(), root, 24, 12, TAPS, slots=2, progress=False)
    return root


def test_graph_features_keep_the_answers_and_equal_the_targets_states(real_model, real_bundle, answer_store,
                                                                         tmp_path):
    out = tmp_path / "graph"
    summary = featurize_store(answer_store, out, real_bundle, threads=2, progress=False)
    src, got = MappedData(answer_store), MappedData(out)
    assert len(got) == len(src) == summary["sequences"] and got.taps == TAPS
    assert got.heldout.tolist() == src.heldout.tolist() and got.prompt_lens.tolist() == src.prompt_lens.tolist()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["key"]["features"]["graph"] == "target"  # never mixed with a store of torch features
    for i in range(len(got)):
        tokens = got.fetch("tokens", i)
        assert tokens.tolist() == src.fetch("tokens", i).tolist()
        t = len(tokens)
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool))[None]
        logits, hidden, aux = real_model.module(tokens[None], torch.arange(t)[None], torch.zeros(1, dtype=torch.long),
                                                causal, real_model.module.new_kv(1, t), taps=TAPS)
        # the fp32 bundle's graph computes the fp32 target: equal up to kernel rounding and fp16 storage
        for name, want in (("hidden", hidden[0]), ("aux", aux[0])):
            have = got.fetch(name, i).float()
            assert have.shape == want.shape
            assert float((have - want).abs().max()) <= 2e-3 * float(want.abs().max()), name
        agree = (got.fetch("top_ids", i)[:, 0] == logits[0].argmax(-1)).float().mean()
        assert agree >= 0.97  # near-ties may swap under other rounding; the rest is the same argmax
        p = got.fetch("top_p", i).float()
        assert torch.allclose(p.sum(-1), torch.ones(t), atol=1e-2) and bool((p[:, :-1] >= p[:, 1:]).all())
    again = featurize_store(answer_store, out, real_bundle, threads=2, progress=False)
    assert again["sequences"] == summary["sequences"] and len(json.loads((out / "meta.json").read_text())["shards"]) \
        == len(meta["shards"])  # resumable: nothing is made twice


def test_a_features_store_from_before_stores_could_grow_follows_its_grown_answer_store(real_model, real_bundle,
                                                                                        answer_store, tmp_path):
    """Both stores keyed by one digest of the whole prompt list (an earlier specrt): the answer store is
    upgraded by its own list, grows by a prompt, and featurizing extends the old features store."""
    import hashlib
    import shutil

    src, out = tmp_path / "answers", tmp_path / "graph"
    shutil.copytree(answer_store, src)
    featurize_store(src, out, real_bundle, threads=2, progress=False)
    text = "\n".join(f"{p['split']}\t{p['prompt']}" for p in store_prompts())
    for root in (src, out):
        meta = json.loads((root / "meta.json").read_text())
        meta["key"]["prompts"] = hashlib.sha256(text.encode()).hexdigest()[:16]
        del meta["prompts"]
        (root / "meta.json").write_text(json.dumps(meta))
    before = len(MappedData(out))
    build_store(real_model, store_prompts(train=3), src, 36, 12, TAPS, slots=2, progress=False)
    assert len(MappedData(src)) > before
    featurize_store(src, out, real_bundle, threads=2, progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert "prompts" not in meta["key"] and meta["prompts"] == json.loads((src / "meta.json").read_text())["prompts"]
    got, want = MappedData(out), MappedData(src)
    assert len(got) == len(want) and got.heldout.tolist() == want.heldout.tolist()


def test_the_answer_store_is_never_its_own_features_store(real_bundle, answer_store):
    with pytest.raises(SpecrtError, match="name another folder"):
        featurize_store(answer_store, answer_store, real_bundle, progress=False)


def test_a_graph_without_the_exporters_layer_names_is_refused(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4])
    y = helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, [1, 2, 4])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["hidden_states"])], "g", [x], [y])
    path = tmp_path / "decoder.onnx"
    onnx.save_model(helper.make_model(graph), str(path))
    (tmp_path / "out").mkdir()
    with pytest.raises(SpecrtError, match="export the bundle again"):
        tapped_graph(path, (0,), tmp_path / "out")

