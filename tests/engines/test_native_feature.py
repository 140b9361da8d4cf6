"""Drafter layers on the native kernels (EAGLE-3's concat mix, EAGLE's and MTP's projected mixes): the same layer
as ONNX Runtime's graph (within int8 rounding), which backend runs a layer (the `drafter_layers` branch, both
values), and every value of the branch lossless end to end on the int4 default configuration."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.engines.native import library
from specrt.errors import SpecrtError
from specrt.runtime.drafters.features import layer_backend
from specrt.schema.manifest import Manifest

CAPACITY = 96
NATIVE_KINDS = ("eagle3", "eagle", "mtp")  # each mix the kernels compute (engines/native/feature.py MIXES)


def _layer(bundle, kind: str):
    """(manifest, `kind`'s (first) layer path, its fuse path or None, layer config) of the trained int4 bundle."""
    m = Manifest.load(bundle)
    layer, *fuse = m.drafter(kind, bundle)["graphs"]
    return (m, m.onnx_path(bundle, layer), m.onnx_path(bundle, fuse[0]) if fuse else None, m.graphs[layer].config)


@pytest.fixture(scope="module")
def layers(trained_int4_bundle):
    """EAGLE-3's: (manifest, layer path, fuse path, layer config)."""
    return _layer(trained_int4_bundle, "eagle3")


def assert_same_winners(got: np.ndarray, want: np.ndarray) -> None:
    """Every row whose best logit leads the next by more than twice the largest difference between the two
    computations drafts the same token (a briefly trained head's near-ties may go either way)."""
    top2 = np.sort(want, axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 2 * np.abs(got - want).max()
    assert (got.argmax(-1) == want.argmax(-1))[clear].all()


def _passes(dec, rng, vocab, table=None):
    """A causal prefill of 30 rows, then a tree window after it: (logits, features) of both. `table`: the
    target's embedding, whose rows an ONNX Runtime layer reads as inputs_embeds (the native one gathers them)."""
    h = dec.cfg.hidden_size
    feats = rng.standard_normal((30, h)).astype(np.float32)
    ids = rng.integers(0, vocab, 30)
    embeds = (lambda i: {}) if table is None else (lambda i: {"inputs_embeds": np.asarray(table[i])[None]})  # noqa: E731
    a = dec.run(ids[None], np.arange(30)[None], np.array([0]), np.tril(np.ones((30, 30), bool))[None],
                np.array([[29]]), hidden_in=feats[None], **embeds(ids))
    a = [x.copy() for x in a]
    tree = np.eye(5, dtype=bool)
    tree[1:, 0] = True
    tree[3, 1] = tree[4, 2] = True
    b = dec.run(ids[None, :5], np.array([[30, 31, 31, 32, 32]]), np.array([30]), tree[None], np.arange(5)[None],
                hidden_in=feats[None, :5], **embeds(ids[:5]))
    return a, [x.copy() for x in b]


@pytest.mark.parametrize("kernel", list(library.KERNELS))
@pytest.mark.parametrize("kind", NATIVE_KINDS)
def test_the_native_layer_computes_the_graphs_layer(trained_int4_bundle, kind, kernel):
    from specrt.engines.native.feature import NativeFeatureLayer
    from specrt.engines.ort_cpu.runner import OrtDecoder

    if not library.supported(kernel):
        pytest.skip(f"this CPU cannot execute the {kernel} kernel (it needs {library.NEEDS[kernel]})")
    m, layer, fuse, cfg = _layer(trained_int4_bundle, kind)
    from specrt.engines.tables import embedding_table

    table = embedding_table(trained_int4_bundle / m.target.file)  # the layer reads inputs_embeds
    native = NativeFeatureLayer(layer, fuse, cfg, CAPACITY, 2, kernel=kernel, embedding=table)
    assert native.mix.kind == kind
    ort = OrtDecoder(layer, cfg, CAPACITY, 2, spin=False)
    vocab = m.target.config.vocab_size
    for (ln, hn), (lo, ho) in zip(_passes(native, np.random.default_rng(0), vocab),
                                  _passes(ort, np.random.default_rng(0), vocab, table), strict=True):
        assert ln.shape == lo.shape and hn.shape == ho.shape
        # int8 activations against ONNX Runtime's arithmetic: close, not equal (only proposals depend on it)
        assert np.abs(ln - lo).max() <= 0.02 * np.abs(lo).max(), np.abs(ln - lo).max()
        assert np.abs(hn - ho).max() <= 0.02 * np.abs(ho).max()
        assert_same_winners(ln, lo)
    if fuse is None:  # EAGLE-3's fuse alone
        return
    aux = np.random.default_rng(1).standard_normal((3, len(m.drafter("eagle3", layer.parents[1])["taps"])
                                                    * m.target.config.hidden_size)).astype(np.float32)
    import onnxruntime

    want = onnxruntime.InferenceSession(str(fuse), providers=["CPUExecutionProvider"]).run(
        None, {"aux_hidden_states": aux[None]})[0][0]
    got = native.fuse(aux)
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()


@pytest.mark.parametrize("kernel", list(library.KERNELS))
def test_the_native_medusa_heads_compute_the_graphs_heads(trained_int4_bundle, kernel):
    """Every head's blocks in one product, the shared head over the K rows in another: the graph's logits within
    int8 rounding, for rows of one and of several hidden states."""
    import onnxruntime

    from specrt.engines.native.medusa import NativeMedusaHeads

    if not library.supported(kernel):
        pytest.skip(f"this CPU cannot execute the {kernel} kernel (it needs {library.NEEDS[kernel]})")
    m = Manifest.load(trained_int4_bundle)
    path = m.onnx_path(trained_int4_bundle, m.drafter("medusa", trained_int4_bundle)["graphs"][0])
    native = NativeMedusaHeads(path, 2, kernel=kernel)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for rows in (1, 3):
        hidden = np.random.default_rng(rows).standard_normal((rows, native.hidden)).astype(np.float32) * 2
        got, want = native.run(hidden), session.run(None, {"hidden_in": hidden[None]})[0][0]
        assert got.shape == want.shape == (rows, native.heads, native.vocab)
        assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()
        assert_same_winners(got, want)
    with pytest.raises(SpecrtError, match="read rows of"):
        native.run(np.zeros((1, native.hidden + 1), np.float32))


def test_medusa_heads_of_their_own_stay_on_onnx_runtime(trained_int4_bundle, tmp_path):
    """A head per Medusa head (public checkpoints' layout) is not one product the kernels run: named, not read."""
    import onnx

    from specrt.engines.native.medusa import OWN_HEADS, NativeMedusaHeads, medusa_unsupported

    m = Manifest.load(trained_int4_bundle)
    path = m.onnx_path(trained_int4_bundle, m.drafter("medusa", trained_int4_bundle)["graphs"][0])
    assert medusa_unsupported(path) == ""
    model = onnx.load(str(path))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros((1, 1, 1), np.float32), OWN_HEADS))
    onnx.save(model, str(tmp_path / "medusa.onnx"))
    assert medusa_unsupported(tmp_path / "medusa.onnx") == "its heads have LM heads of their own"
    with pytest.raises(SpecrtError, match="cannot run these Medusa heads: its heads have LM heads of their own"):
        NativeMedusaHeads(tmp_path / "medusa.onnx")


def test_a_catch_up_fuses_the_tapped_rows_in_its_own_call(layers, trained_int4_bundle):
    """aux_in: the layer fuses the target's tapped rows itself, bitwise what the fuse call then a pass over its
    features computes; one or the other is given, never both, and a wrong width is an error, not a read."""
    from specrt.engines.native.feature import NativeFeatureLayer
    from specrt.engines.tables import embedding_table

    m, layer, fuse, cfg = layers
    table = embedding_table(trained_int4_bundle / m.target.file)
    rng = np.random.default_rng(2)
    width = len(m.drafter("eagle3", trained_int4_bundle)["taps"]) * cfg.hidden_size
    aux = rng.standard_normal((1, 12, width)).astype(np.float32)
    ids = rng.integers(0, m.target.config.vocab_size, 12)[None]
    args = (ids, np.arange(12)[None], np.array([0]), np.tril(np.ones((12, 12), bool))[None], np.array([[10, 11]]))
    two = NativeFeatureLayer(layer, fuse, cfg, CAPACITY, 2, embedding=table)
    one = NativeFeatureLayer(layer, fuse, cfg, CAPACITY, 2, embedding=table)
    want = two.run_all(*args, hidden_in=two.fuse(aux[0])[None])
    got = one.run_all(*args, aux_in=aux)
    for name in ("logits", "hidden_states"):
        assert np.array_equal(got[name], want[name]), name
    with pytest.raises(SpecrtError, match="hidden_in or aux_in"):
        one.run_all(*args, hidden_in=want["hidden_states"], aux_in=aux)
    with pytest.raises(SpecrtError, match="hidden_in or aux_in"):
        one.run_all(*args)
    lib = one.lib  # the C entry point checks the width it is given against the fuse's
    out = [np.zeros((1, 2, one.vocab), np.float32), np.zeros((1, 12, cfg.hidden_size), np.float32)]
    from specrt.engines.native import calls

    flat = [np.ascontiguousarray(a) for a in (ids.reshape(-1), np.arange(12), np.array([0]),
                                              np.tril(np.ones((12, 12), bool)), np.array([10, 11]))]
    rc = lib.spn_feature_pass(one._h, 12, calls.ptr(flat[0]), None, calls.ptr(aux), aux.size - 1, calls.ptr(flat[1]),
                              calls.ptr(flat[2]), calls.ptr(flat[3]), 2, calls.ptr(flat[4]), one._kv_pointers(0),
                              CAPACITY, calls.ptr(out[0]), calls.ptr(out[1]))
    assert rc != 0 and f"{aux.size - 1} tapped values for 12 rows" in library.last_error()


def test_a_causal_catch_up_is_the_pass_run_all_computes(layers, trained_int4_bundle):
    """`causal` (a catch-up's pass, its inputs in buffers made once) gives bitwise what run_all gives for the same
    window, its cache included, at every window length and start a step makes; a wrong size is an error."""
    from specrt.engines.native.feature import NativeFeatureLayer
    from specrt.engines.tables import embedding_table

    m, layer, fuse, cfg = layers
    table = embedding_table(trained_int4_bundle / m.target.file)
    rng = np.random.default_rng(4)
    width = len(m.drafter("eagle3", trained_int4_bundle)["taps"]) * cfg.hidden_size
    aux = rng.standard_normal((60, width)).astype(np.float32)
    ids = rng.integers(0, m.target.config.vocab_size, 61).tolist()
    lean = NativeFeatureLayer(layer, fuse, cfg, CAPACITY, 2, embedding=table)
    full = NativeFeatureLayer(layer, fuse, cfg, CAPACITY, 2, embedding=table)
    start = 0
    for t in (7, 1, 2, 3, 1, 4, 2, 30):  # a prompt's rows, then steps of 1..4 accepted rows
        got = lean.causal(ids[start + 1 : start + 1 + t], aux[start : start + t], start)
        got = {k: v.copy() for k, v in got.items()}
        want = full.run_all(np.asarray(ids[start + 1 : start + 1 + t])[None], np.arange(start, start + t)[None],
                            np.array([start]), np.tril(np.ones((t, t), bool))[None], np.array([[t - 1]]),
                            aux_in=aux[None, start : start + t])
        for name in ("logits", "hidden_states"):
            assert np.array_equal(got[name], want[name]), (t, start, name)
        assert all(np.array_equal(a, b) for a, b in zip(lean.kv, full.kv, strict=True)), (t, start)
        start += t
    with pytest.raises(SpecrtError, match="causal catch-up of 2 rows"):
        lean.causal(ids[:2], aux[:3], 0)
    with pytest.raises(SpecrtError, match="KV capacity"):
        lean.causal(ids[:2], aux[:2], CAPACITY - 1)


def test_the_branch_follows_the_target_and_the_layer(layers, trained_int4_bundle, monkeypatch):
    m, layer, _, cfg = layers
    monkeypatch.delenv("SPECRT_DRAFTER_LAYERS", raising=False)
    assert layer_backend(layer, cfg, "native")[0] == "native"
    assert layer_backend(layer, cfg, "ort") == ("ort", {"value": "ort", "forced": False,
                                                        "chosen_by": "auto: the target runs on ort"})
    for kind in NATIVE_KINDS:
        _, path, _, kind_cfg = _layer(trained_int4_bundle, kind)
        assert layer_backend(path, kind_cfg, "native")[0] == "native", kind
    (medusa,) = m.drafter("medusa", trained_int4_bundle)["graphs"]
    assert layer_backend(m.onnx_path(trained_int4_bundle, medusa), m.graphs[medusa].config, "native",
                         graph="medusa")[0] == "native"
    # the block drafter's mask rows (a learned embedding and feature where the id is -1): ONNX Runtime
    (block, *_) = m.drafter("block", trained_int4_bundle)["graphs"]
    name, rec = layer_backend(m.onnx_path(trained_int4_bundle, block), m.graphs[block].config, "native")
    assert name == "ort" and "its mix is none the kernels compute" in rec["chosen_by"]
    monkeypatch.setenv("SPECRT_DRAFTER_LAYERS", "ort")
    assert layer_backend(layer, cfg, "native") == ("ort", {"value": "ort", "forced": True,
                                                           "chosen_by": "SPECRT_DRAFTER_LAYERS"})
    monkeypatch.setenv("SPECRT_DRAFTER_LAYERS", "native")
    assert layer_backend(layer, cfg, "ort")[0] == "native"  # forced: even under another target backend
    with pytest.raises(SpecrtError, match="cannot run there: its mix is none the kernels compute"):
        layer_backend(m.onnx_path(trained_int4_bundle, block), m.graphs[block].config, "native")


@pytest.mark.parametrize("layers_on", ["native", "ort"])
def test_eagle3_is_lossless_with_either_layer_backend(trained_int4_bundle, layers_on, monkeypatch):
    from specrt.runtime.generate import Generator

    monkeypatch.setenv("SPECRT_DRAFTER_LAYERS", layers_on)
    # EAGLE-2's tree (not the chain the machine's costs would size): the briefly trained head's drafts are
    # accepted somewhere in 10 nodes, which shows the layer's outputs are right
    gen = Generator(trained_int4_bundle, drafter="eagle3", max_seq_len=256, backend="native", tree_nodes=10, beam=4)
    assert gen.drafter.layer.backend == layers_on
    plain = Generator(trained_int4_bundle, drafter="plain", max_seq_len=256, backend="native")
    for prompt in ("Name three colours.", "Write one sentence about the sea."):
        ids = gen.tokenizer.encode_prompt(prompt)
        got, want = gen.generate_ids(ids, 48), plain.generate_ids(ids, 48)
        assert got.token_ids == want.token_ids
        assert got.stats.accepted > 0  # the layer really drafted
        # each drafted step: one catch-up pass (native: it fuses the tapped rows itself; ONNX Runtime: a fuse
        # call before it), then one pass per further draft level
        catch_up = 1 if layers_on == "native" else 2
        assert catch_up * got.stats.steps <= got.stats.draft_calls <= got.stats.steps * (catch_up + gen.drafter.depth - 1)


# EAGLE-2 over EAGLE-1/2's layer in a 10-node tree, whose drafts the briefly trained head gets accepted; MTP's chain
# of modules, each a layer of its own; Medusa's heads in its static tree
PROJECTED = {"eagle2": {"tree_nodes": 10, "beam": 4}, "mtp": {}, "medusa": {}}


def _backends(drafter) -> list[str]:
    """Where each of a drafter's graphs runs: its layers', or its own (Medusa's heads)."""
    layers = getattr(drafter, "layers", None) or [getattr(drafter, "layer", drafter)]
    return [layer.backend for layer in layers]


@pytest.mark.parametrize("layers_on", ["native", "ort"])
@pytest.mark.parametrize("drafter", list(PROJECTED))
def test_projected_mixes_and_medusa_are_lossless_with_either_backend(trained_int4_bundle, drafter, layers_on,
                                                                     monkeypatch):
    from specrt.runtime.generate import Generator

    monkeypatch.setenv("SPECRT_DRAFTER_LAYERS", layers_on)
    gen = Generator(trained_int4_bundle, drafter=drafter, max_seq_len=256, backend="native", **PROJECTED[drafter])
    backends = _backends(gen.drafter)
    assert backends == [layers_on] * len(backends)
    plain = Generator(trained_int4_bundle, drafter="plain", max_seq_len=256, backend="native")
    accepted = 0
    for prompt in ("Name three colours.", "Write one sentence about the sea."):
        ids = gen.tokenizer.encode_prompt(prompt)
        got, want = gen.generate_ids(ids, 48), plain.generate_ids(ids, 48)
        assert got.token_ids == want.token_ids
        # the graphs really ran: a call or more each step (but a last one with no room left to draft)
        assert got.stats.draft_calls >= got.stats.steps - 1
        accepted += got.stats.accepted
    assert accepted > 0 or not PROJECTED[drafter]  # a tree's drafts are accepted somewhere


@pytest.mark.parametrize("layers_on", ["native", "ort"])
def test_the_draft_model_is_lossless_on_either_backend(trained_int4_bundle, layers_on, monkeypatch):
    """The int4 draft model runs on the target's kernels under auto when the target does (`drafter_layers`,
    decoder graphs too); forced either way, its drafts change speed only: output equals plain."""
    from specrt.runtime.drafters.features import layer_backend
    from specrt.runtime.generate import Generator

    m = Manifest.load(trained_int4_bundle)
    path, cfg = m.onnx_path(trained_int4_bundle, "draft"), m.graphs["draft"].config
    monkeypatch.delenv("SPECRT_DRAFTER_LAYERS", raising=False)
    assert layer_backend(path, cfg, "native", graph="decoder")[0] == "native"
    assert layer_backend(path, cfg, "ort", graph="decoder")[0] == "ort"
    monkeypatch.setenv("SPECRT_DRAFTER_LAYERS", layers_on)
    gen = Generator(trained_int4_bundle, drafter="draft", max_seq_len=256, backend="native", num_draft_tokens=3)
    assert gen.drafter.backend == layers_on and gen.drafter.record["value"] == layers_on
    plain = Generator(trained_int4_bundle, drafter="plain", max_seq_len=256, backend="native")
    for prompt in ("Name three colours.", "Write one sentence about the sea."):
        ids = gen.tokenizer.encode_prompt(prompt)
        got, want = gen.generate_ids(ids, 40), plain.generate_ids(ids, 40)
        assert got.token_ids == want.token_ids
        assert got.stats.draft_calls >= got.stats.steps  # the draft model really ran


@pytest.fixture(scope="module")
def int8_drafter_bundle(tmp_path_factory, tokenizer_dir):
    """A tiny random target in int4 with a random EAGLE-3 drafter in int8 (`--drafter-quantize int8`)."""
    from specrt.export.bundle import ExportOptions, export_bundle
    from specrt.export.loading import load_model
    from tests.helpers import random_drafters, save_random_drafters, save_tiny_folder

    tmp = tmp_path_factory.mktemp("int8_drafter")
    folder = save_tiny_folder(tmp / "llama", "llama", tokenizer_dir, vocab_size=49152, max_position_embeddings=256)
    target = load_model(folder, keep_hf=False)
    requested = save_random_drafters(tmp, target, {"eagle3": random_drafters()["eagle3"]})
    export_bundle(target, tmp / "bundle", ExportOptions(draft_layers=0, progress=False, quantize="int4",
                                                        drafter_quantize="int8", drafters=tuple(requested)))
    return tmp / "bundle"


@pytest.mark.parametrize("kernel", list(library.KERNELS))
def test_an_int8_drafter_layer_runs_on_the_kernels_as_the_graph_does(int8_drafter_bundle, kernel):
    """--drafter-quantize int8: the target stays int4, the drafter's projections are 8-bit blocks, and the native
    layer computes them as ONNX Runtime's graph does (within int8 rounding of the activations)."""
    import onnx

    from specrt.engines.native.feature import NativeFeatureLayer
    from specrt.engines.native.weights import int4_projection
    from specrt.engines.ort_cpu.runner import OrtDecoder
    from specrt.engines.tables import embedding_table

    if not library.supported(kernel):
        pytest.skip(f"this CPU cannot execute the {kernel} kernel (it needs {library.NEEDS[kernel]})")
    m, layer, fuse, cfg = _layer(int8_drafter_bundle, "eagle3")
    q = m.artifacts["quantization"]
    assert (q["scheme"], q["drafters"]["scheme"]) == ("int4", "int8")

    def bits(path):
        return {onnx.helper.get_attribute_value(a) for n in onnx.load(str(path), load_external_data=False).graph.node
                if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"}

    assert bits(m.onnx_path(int8_drafter_bundle, "target")) == {4}
    assert bits(layer) == bits(fuse) == {8}
    model = onnx.load(str(layer))
    inits = {t.name: t for t in model.graph.initializer}
    by_weight = {n.input[1]: n for n in model.graph.node if n.op_type == "MatMulNBits"}
    assert int4_projection(layer, inits, by_weight, "layer.qkv_proj.weight").format == "q8"
    table = embedding_table(int8_drafter_bundle / m.target.file)
    native = NativeFeatureLayer(layer, fuse, cfg, CAPACITY, 2, kernel=kernel, embedding=table)
    ort = OrtDecoder(layer, cfg, CAPACITY, 2, spin=False)
    vocab = m.target.config.vocab_size
    for (ln, hn), (lo, ho) in zip(_passes(native, np.random.default_rng(0), vocab),
                                  _passes(ort, np.random.default_rng(0), vocab, table), strict=True):
        assert np.abs(ln - lo).max() <= 0.02 * np.abs(lo).max(), np.abs(ln - lo).max()
        assert np.abs(hn - ho).max() <= 0.02 * np.abs(ho).max()
        assert_same_winners(ln, lo)


def test_an_int8_drafter_keeps_the_output_the_targets(int8_drafter_bundle):
    from specrt.runtime.generate import Generator

    gen = Generator(int8_drafter_bundle, drafter="eagle3", max_seq_len=128, backend="native", tree_nodes=6, beam=3)
    assert gen.drafter.layer.backend == "native"
    plain = Generator(int8_drafter_bundle, drafter="plain", max_seq_len=128, backend="native")
    prompt = [3, 4, 5, 3, 4, 5, 3, 4, 9, 12]
    got, want = gen.generate_ids(prompt, 40), plain.generate_ids(prompt, 40)
    assert got.token_ids == want.token_ids and got.stats.draft_calls >= got.stats.steps


def test_a_drafters_head_is_the_targets_own_head_rows(trained_int4_bundle):
    """A GGUF target's LM head is carried in its own blocks (Q8_0 here); EAGLE-3's head, the target's rows of its
    draft vocabulary, carries those very blocks, not a second rounding of them."""
    import onnx

    from specrt.engines.native.weights import int4_projection, read

    m = Manifest.load(trained_int4_bundle)
    carried = m.artifacts["quantization"]["from_model_file"]
    assert carried["eagle3"] == {"weights": 1, "formats": ["q8"]}
    target = read(trained_int4_bundle / m.target.file, m.target.config).head
    _, layer, _, _ = _layer(trained_int4_bundle, "eagle3")
    model = onnx.load(str(layer))
    inits = {t.name: t for t in model.graph.initializer}
    by_weight = {n.input[1]: n for n in model.graph.node if n.op_type == "MatMulNBits"}
    head = int4_projection(layer, inits, by_weight, "lm_head.weight.T")
    ids = np.load(trained_int4_bundle / m.drafter("eagle3", trained_int4_bundle)["vocab_ids"])
    assert head.format == target.format == "q8" and head.n == len(ids)
    assert np.array_equal(head.q, target.q[ids]) and np.array_equal(head.scales, target.scales[ids])
