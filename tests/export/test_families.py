"""Every supported family and every honoured config option, end to end: a tiny random transformers model
is exported through specrt's export path, and greedy decoding through ONNX Runtime gives transformers'
own greedy tokens. Config values specrt does not compute exactly are refused at load, in one line."""

from __future__ import annotations

from dataclasses import replace

import onnx
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from specrt.errors import SpecrtError
from specrt.export.archs import ARCHS
from specrt.export.bundle import ExportOptions, export_bundle
from specrt.export.config_rules import RULES, check_config
from specrt.export.loading import LoadedModel, load_model, module_from_hf
from specrt.plugins.tree_attention import WINDOWED_NAME, function_name
from specrt.runtime.generate import Generator
from tests.helpers import FAMILY_OVERRIDES, TINY, save_tiny_folder, save_word_tokenizer

NEW_TOKENS = 24
ROPE = dict(rope_theta=10000.0, original_max_position_embeddings=16)
GEMMA3_ROPE = dict(full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                   sliding_attention=dict(rope_type="default", rope_theta=1e4))

# name -> (model_type, config overrides): each family, and each option it honours
ACCEPTED = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-head-dim": ("llama", dict(head_dim=32)),  # heads * head_dim = 128 != hidden 64
    "llama-rope-linear": ("llama", dict(rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=10000.0))),
    "llama-rope-llama3": ("llama", dict(rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                             high_freq_factor=4.0, **ROPE))),
    "llama-rope-yarn": ("llama", dict(rope_parameters=dict(rope_type="yarn", factor=4.0, **ROPE))),
    "mistral": ("mistral", {}),
    "mistral-window-unreachable": ("mistral", dict(sliding_window=256)),  # = max_position_embeddings
    "qwen2": ("qwen2", {}),
    "qwen2-window-off": ("qwen2", dict(sliding_window=4, use_sliding_window=False, max_window_layers=0)),
    "qwen3": ("qwen3", {}),
    "qwen3-bias-tied": ("qwen3", dict(attention_bias=True, tie_word_embeddings=True)),
    # sliding windows shorter than the 12-token prompt: every generated token is past the window
    "mistral-window": ("mistral", dict(sliding_window=5)),
    "qwen2-window-max-layers": ("qwen2", dict(sliding_window=4, use_sliding_window=True, max_window_layers=1)),
    "qwen2-window-layer-types": ("qwen2", dict(sliding_window=3, use_sliding_window=True,
                                               layer_types=["sliding_attention", "full_attention"])),
    "qwen3-window": ("qwen3", dict(sliding_window=6, use_sliding_window=True, max_window_layers=0)),
    "phi3": ("phi3", {}),  # fused qkv_proj / gate_up_proj, split at load
    "phi3-window": ("phi3", dict(sliding_window=5)),
    "phi3-longrope-short": ("phi3", dict(rope_parameters=dict(  # never passes original: the short factors
        rope_type="longrope", short_factor=[1.0 + i / 8 for i in range(8)], long_factor=[4.0] * 8,
        rope_theta=10000.0, original_max_position_embeddings=256))),
    # Gemma: (1 + w) norms, sqrt(hidden) embeddings, gelu-tanh, tied head (tests/helpers.py FAMILY_OVERRIDES)
    "gemma": ("gemma", {}),
    "gemma-legacy-gelu": ("gemma", dict(hidden_act="gelu")),  # transformers reads it as gelu_pytorch_tanh
    # + sandwich norms, query_pre_attn_scalar, softcapped scores and logits; window 5 < the 12-token prompt
    "gemma2": ("gemma2", {}),
    "gemma2-window": ("gemma2", dict(sliding_window=5)),
    # + qk-norm, local/global RoPE tables per layer type (scaling on the global one only)
    "gemma3_text": ("gemma3_text", {}),
    "gemma3-window": ("gemma3_text", dict(sliding_window=5)),
    "gemma3-rope-linear-global": ("gemma3_text", dict(rope_parameters=GEMMA3_ROPE)),
}

# (model_type, overrides, the config field the one-line refusal names)
REFUSED = [
    ("llama", dict(hidden_act="gelu"), "hidden_act = 'gelu'"),
    ("mistral", dict(hidden_act="relu"), "hidden_act = 'relu'"),
    ("llama", dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)),
     "rope_parameters.rope_type = 'dynamic'"),
    ("llama", dict(rope_parameters=dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8,
                                        **ROPE)), "rope_parameters.original_max_position_embeddings = 16"),
    ("llama", dict(partial_rotary_factor=0.5), "partial_rotary_factor = 0.5"),
    ("phi3", dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
     "partial_rotary_factor = 0.5"),
    ("phi3", dict(original_max_position_embeddings=16,  # Phi-3 copies it into rope_parameters
                  rope_parameters=dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8, **ROPE)),
     "rope_parameters.original_max_position_embeddings = 16"),
    ("gemma2", dict(hidden_activation="gelu"), "hidden_activation = 'gelu'"),
    ("gemma3_text", dict(rope_parameters={**GEMMA3_ROPE, "full_attention": dict(
        rope_type="dynamic", factor=2.0, rope_theta=1e6)}), "rope_parameters.rope_type = 'dynamic'"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention = True"),
    ("gemma2", dict(layer_types=["chunked_attention", "full_attention"]), "layer_types = ('chunked_attention'"),
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return save_word_tokenizer(tmp_path_factory.mktemp("word_tokenizer"), TINY["vocab_size"])


def prompt_ids(length: int = 12) -> list[int]:
    return torch.randint(1, TINY["vocab_size"], (length,), generator=torch.Generator().manual_seed(3)).tolist()


def transformers_greedy(hf, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


def exported(tmp_path, tokenizer, model_type: str, overrides: dict):
    """(transformers model, bundle): the saved tiny folder as load_model reads it, with the word tokenizer."""
    folder = save_tiny_folder(tmp_path / model_type, model_type, None, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    loaded = LoadedModel(module=module_from_hf(hf), tokenizer=PreTrainedTokenizerFast.from_pretrained(tokenizer),
                         source=str(folder), hf_config=hf.config)
    bundle = tmp_path / "bundle"
    export_bundle(loaded, bundle, ExportOptions(draft_layers=None, progress=False))
    return hf, bundle


def test_every_family_has_a_greedy_case():
    assert {model_type for model_type, _ in ACCEPTED.values()} == set(ARCHS) == set(FAMILY_OVERRIDES)


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_greedy_tokens_equal_transformers(name, tmp_path, tokenizer):
    model_type, overrides = ACCEPTED[name]
    hf, bundle = exported(tmp_path, tokenizer, model_type, overrides)
    prompt = prompt_ids()
    want = transformers_greedy(hf, prompt, NEW_TOKENS)
    got = Generator(bundle, max_seq_len=64).generate_ids(prompt, NEW_TOKENS).token_ids
    assert got == want, f"{name}: specrt {got} != transformers {want}"


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, tokenizer):
    return exported(tmp_path_factory.mktemp("windowed"), tokenizer, "mistral", dict(sliding_window=5))


def ngram_equals_plain_and_transformers(hf, bundle) -> tuple[list[int], list[int]]:
    """(prompt, plain tokens): plain greedy equals transformers', and ngram drafts (chain and tree) equal plain
    with drafts accepted. The prompt repeats, so prompt lookup drafts and some drafts are accepted."""
    prompt = prompt_ids(6) * 3
    plain = Generator(bundle, max_seq_len=96).generate_ids(prompt, 40).token_ids
    assert plain == transformers_greedy(hf, prompt, 40)
    for tree in (None, "default"):
        res = Generator(bundle, drafter="ngram", tree=tree, max_seq_len=96).generate_ids(prompt, 40)
        assert res.token_ids == plain, f"ngram tree={tree} differs from plain"
        assert res.stats.accepted > 0, f"ngram tree={tree} accepted nothing: the check proves little"
    return prompt, plain


def test_windowed_speculation_equals_plain_and_the_window_matters(windowed):
    """ngram drafts (chain and tree) through TreeAttentionWindowed give plain greedy's tokens, past the
    window; and the window changes them (transformers without it answers otherwise)."""
    hf, bundle = windowed
    prompt, plain = ngram_equals_plain_and_transformers(hf, bundle)
    hf.config.sliding_window = None
    try:
        assert transformers_greedy(hf, prompt, 40) != plain, "the window changes nothing on this prompt"
    finally:
        hf.config.sliding_window = 5


def test_windowed_bundles_are_refused_where_the_window_is_not_implemented(windowed):
    """ort-fused keeps the unfused graph (GroupQueryAttention gets no window); TensorRT refuses in one line."""
    from specrt.engines.ort_cpu.fuse import fuse_attention
    from specrt.engines.trt import profiles
    from specrt.schema.manifest import Manifest

    _, bundle = windowed
    manifest = Manifest.load(bundle)
    assert manifest.target.config.layer_windows == (5, 5)
    model = onnx.load(str(bundle / manifest.target.file), load_external_data=False)
    assert {f.name for f in model.functions} == {WINDOWED_NAME}
    assert fuse_attention(model, manifest.target.config) is None
    with pytest.raises(SpecrtError, match=r"sliding-window attention \(layer windows \[5\]\).*--backend ort$"):
        profiles.check_bundle(manifest)
    from specrt.engines.registry import fused_graph  # the user is told why, not sent to `specrt build`

    with pytest.raises(SpecrtError, match=r"ort-fused does not lower sliding-window attention; use --backend ort"):
        fused_graph(bundle, manifest, "target")


@pytest.fixture(scope="module")
def gemma2_windowed(tmp_path_factory, tokenizer):
    return exported(tmp_path_factory.mktemp("gemma2_windowed"), tokenizer, "gemma2", dict(sliding_window=5))


def test_gemma2_speculation_equals_plain_through_softcapped_windowed_attention(gemma2_windowed):
    """Gemma-2 (windowed and full layers, both softcapped): ngram drafts (chain and tree) give plain greedy's
    tokens past the window, plain greedy gives transformers'; ort-fused keeps the unfused graph and TensorRT
    refuses, in one line, what its plugin does not compute."""
    from specrt.engines.ort_cpu.fuse import fuse_attention
    from specrt.engines.trt import profiles
    from specrt.schema.manifest import Manifest

    hf, bundle = gemma2_windowed
    prompt, plain = ngram_equals_plain_and_transformers(hf, bundle)
    hf.config.sliding_window = 1000  # and the window matters on this prompt (Gemma-2's cache needs one)
    try:
        assert transformers_greedy(hf, prompt, 40) != plain, "the window changes nothing on this prompt"
    finally:
        hf.config.sliding_window = 5
    manifest = Manifest.load(bundle)
    cfg = manifest.target.config
    assert (cfg.layer_windows, cfg.attn_logit_softcapping) == ((5, 0), 0.5)
    model = onnx.load(str(bundle / manifest.target.file), load_external_data=False)
    assert {f.name for f in model.functions} == {function_name(True, True), function_name(False, True)}
    assert fuse_attention(model, replace(cfg, layer_windows=())) is None  # the softcap alone keeps it unfused
    with pytest.raises(SpecrtError, match=r"attn_logit_softcapping 0\.5\).*--backend ort$"):
        profiles.check_bundle(replace_target_config(manifest, layer_windows=()))


def replace_target_config(manifest, **changes):
    """The manifest with its target config's fields changed (a bundle the export would not write)."""
    target = replace(manifest.target, config=replace(manifest.target.config, **changes))
    return replace(manifest, graphs={**manifest.graphs, "target": target})


@pytest.mark.parametrize(("model_type", "overrides", "named"), REFUSED,
                         ids=[f"{r[0]}-{r[2].split(' =')[0]}" for r in REFUSED])
def test_refused_in_one_line(model_type, overrides, named):
    cfg = AutoConfig.for_model(model_type, **{**TINY, **FAMILY_OVERRIDES[model_type], **overrides})
    with pytest.raises(SpecrtError) as e:
        check_config(cfg)
    message = str(e.value)
    assert named in message and "specrt supports" in message and "\n" not in message, message


def test_refused_at_load_before_the_weights(tmp_path, tokenizer):
    """load_model names the folder and refuses before transformers builds the model."""
    folder = save_tiny_folder(tmp_path / "m", "llama", tokenizer, hidden_act="gelu")
    (folder / "model.safetensors").unlink()  # were the weights read, the error would be another one
    with pytest.raises(SpecrtError, match=rf"^{folder}: llama config hidden_act = 'gelu' is not supported"):
        load_model(folder)


def test_every_rule_has_a_refusal_case():
    named = {r[2].split(" =")[0] for r in REFUSED}
    assert {rule.field for rule in RULES} - {"sliding_window"} <= named
