"""Public drafter checkpoint layouts (Medusa, EAGLE-1/2, EAGLE-3, DeepSeek-style MTP) load through
`drafters.load` without unpickling, and give the same outputs as the module they were written from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specrt.errors import SpecrtError
from specrt.export import drafters
from specrt.export.drafters import public
from specrt.export.loading import module_from_hf
from tests.helpers import TINY, tiny_hf_model


@pytest.fixture(scope="module")
def target():
    return module_from_hf(tiny_hf_model("llama"))


def randomized(module, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.requires_grad:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen) + (1.0 if name.endswith("norm.weight") else 0.0))
    return module.eval()


def llama_config(**extra) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **TINY, **extra}


def write(folder: Path, config: dict | None, files: dict[str, dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    for name, state in files.items():
        state = {k: v.detach().contiguous().clone() for k, v in state.items()}
        if name.endswith(".safetensors"):
            save_file(state, folder / name)
        else:
            torch.save(state, folder / name)  # a plain dict of tensors: loads with weights_only=True
    return folder


def step_outputs(mod, seed: int = 2):
    """(logits, out) of a prefill of 5 rows then a 3-node tree, through the KV-cache step."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, mod.dec.vocab_size, (1, 8), generator=gen)
    hid = torch.randn(1, 8, mod.dec.hidden_size, generator=gen)
    kv = mod.new_kv(1, 16)
    results = []
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    for a, b, mask in ((0, 5, torch.tril(torch.ones(5, 5, dtype=torch.bool))), (5, 8, tree)):
        results += mod.step(ids[:, a:b], hid[:, a:b], torch.arange(a, b)[None], torch.tensor([a]), mask[None], kv)
    return results


def assert_same_steps(a, b):
    for x, y in zip(step_outputs(a), step_outputs(b), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- Medusa


def medusa_files(target, suffix=".safetensors", heads=3, layers=2):
    module = randomized(drafters.build(drafters.make_config("medusa", num_heads=heads, num_layers=layers,
                                                            own_heads=True), target))
    state = {k.removeprefix("medusa_head."): v for k, v in module.trainable_state().items()}
    assert set(state) >= {"0.0.linear.weight", "0.0.linear.bias", f"{heads - 1}.{layers}.weight"}
    config = {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": "tiny-llama"}
    return module, config, {f"medusa_lm_head{suffix}": state}


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_medusa_layout(tmp_path, target, suffix):
    module, config, files = medusa_files(target, suffix)
    folder = write(tmp_path / "medusa", config, files)
    assert public.detect(folder) == "medusa"
    loaded = drafters.load(folder, target)
    assert not loaded.training and loaded.cfg.own_heads and loaded.cfg.num_heads == 3
    h = torch.randn(2, 3, target.cfg.hidden_size)
    torch.testing.assert_close(loaded(h), module(h), rtol=0, atol=0)


def test_medusa_errors_name_the_file(tmp_path, target):
    _, config, files = medusa_files(target)
    state = files["medusa_lm_head.safetensors"]
    del state["1.0.linear.bias"]
    folder = write(tmp_path / "missing", config, files)
    with pytest.raises(SpecrtError, match=r"medusa_lm_head\.safetensors.*missing \['1\.0\.linear\.bias'\]"):
        drafters.load(folder, target)

    _, config, files = medusa_files(target)
    files["medusa_lm_head.safetensors"]["0.2.weight"] = torch.randn(7, target.cfg.hidden_size)
    folder = write(tmp_path / "shape", config, files)
    with pytest.raises(SpecrtError, match=r"medusa_lm_head\.safetensors: 0\.2\.weight has shape \(7, 64\).*\(128, 64\)"):
        drafters.load(folder, target)

    folder = write(tmp_path / "noweights", config, {})
    with pytest.raises(SpecrtError, match="no weights"):
        drafters.load(folder, target)


# ---------------------------------------------------------------------------------------------- EAGLE-1/2


@pytest.mark.parametrize(("fc_bias", "input_norm", "name"), [(True, False, "pytorch_model.bin"),
                                                             (False, True, "model.safetensors")])
def test_eagle_layout(tmp_path, target, fc_bias, input_norm, name):
    module = randomized(drafters.build(drafters.make_config("eagle", fc_bias=fc_bias, input_norm=input_norm), target))
    state = dict(module.trainable_state())
    assert ("layers.0.input_layernorm.weight" in state) == input_norm and ("fc.bias" in state) == fc_bias
    state["embed_tokens.weight"] = torch.randn(target.cfg.vocab_size, target.cfg.hidden_size)  # ignored
    folder = write(tmp_path / "eagle", llama_config(bias=fc_bias, num_hidden_layers=1), {name: state})
    assert public.detect(folder) == "eagle"
    loaded = drafters.load(folder, target)
    assert (loaded.cfg.fc_bias, loaded.cfg.input_norm) == (fc_bias, input_norm)
    assert_same_steps(loaded, module)


def test_eagle_errors(tmp_path, target):
    module = randomized(drafters.build(drafters.make_config("eagle"), target))
    state = dict(module.trainable_state())
    state["layers.0.mlp.up_proj.weight"] = state["layers.0.mlp.up_proj.weight"][:, :32]
    folder = write(tmp_path / "shape", llama_config(), {"pytorch_model.bin": state})
    with pytest.raises(SpecrtError, match=r"pytorch_model\.bin: layers\.0\.mlp\.up_proj\.weight has shape \(96, 32\)"):
        drafters.load(folder, target)

    state = dict(module.trainable_state())
    del state["layers.0.self_attn.k_proj.weight"]
    folder = write(tmp_path / "missing", llama_config(), {"model.safetensors": state})
    with pytest.raises(SpecrtError, match=r"model\.safetensors .*missing \['layers\.0\.self_attn\.k_proj\.weight'\]"):
        drafters.load(folder, target)

    folder = write(tmp_path / "dims", llama_config(hidden_size=32), {"model.safetensors": module.trainable_state()})
    with pytest.raises(SpecrtError, match="hidden_size 32"):
        drafters.load(folder, target)

    folder = write(tmp_path / "heads", llama_config(num_attention_heads=8, num_key_value_heads=2, head_dim=8),
                   {"model.safetensors": module.trainable_state()})
    with pytest.raises(SpecrtError, match=r"config\.json: the drafter layer has num_attention_heads 8"):
        drafters.load(folder, target)


class NotATensor:
    pass


def test_bin_is_never_unpickled(tmp_path, target):
    module = drafters.build(drafters.make_config("eagle"), target)
    state = {**module.trainable_state(), "extra": NotATensor()}
    folder = tmp_path / "evil"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(llama_config()))
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(SpecrtError, match=r"pytorch_model\.bin cannot be read as plain tensors.*weights_only"):
        drafters.load(folder, target)


# ---------------------------------------------------------------------------------------------- EAGLE-3


def test_eagle3_layout(tmp_path, target):
    draft_vocab = 40
    module = randomized(drafters.build(drafters.make_config("eagle3", taps=[1, 0], draft_vocab_size=draft_vocab),
                                       target))
    gen = torch.Generator().manual_seed(3)
    chosen = torch.randperm(target.cfg.vocab_size, generator=gen)[:draft_vocab].sort().values
    module.d2t.copy_(chosen - torch.arange(draft_vocab))
    state = {**module.trainable_state(), "lm_head.weight": module.lm_head.weight}  # its own head [draft vocab, H]
    assert state["fc.weight"].shape == (64, 128) and state["midlayer.self_attn.q_proj.weight"].shape[1] == 128
    t2d = torch.zeros(target.cfg.vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    state.update(t2d=t2d, **{"embed_tokens.weight": torch.randn(target.cfg.vocab_size, 64)})
    config = llama_config(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, draft_vocab_size=draft_vocab,
                          eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 0]})
    folder = write(tmp_path / "eagle3", config, {"model.safetensors": state})
    assert public.detect(folder) == "eagle3"
    loaded = drafters.load(folder, target)
    assert loaded.cfg.taps == [1, 0] and loaded.cfg.draft_vocab_size == draft_vocab
    assert torch.equal(loaded.target_ids(), chosen)
    assert_same_steps(loaded, module)
    aux = torch.randn(1, 3, 128)
    torch.testing.assert_close(loaded.fuse(aux), module.fuse(aux), rtol=0, atol=0)


def test_eagle3_errors(tmp_path, target):
    module = randomized(drafters.build(drafters.make_config("eagle3", taps=[0, 1, 1], draft_vocab_size=40), target))
    state = {**module.trainable_state(), "lm_head.weight": module.lm_head.weight}
    folder = write(tmp_path / "taps", llama_config(), {"model.safetensors": state})  # default taps: [0, 1]
    with pytest.raises(SpecrtError, match=r"fc\.weight has shape \(64, 192\).*eagle_aux_hidden_state_layer_ids"):
        drafters.load(folder, target)

    module = randomized(drafters.build(drafters.make_config("eagle3", taps=[0, 1], draft_vocab_size=40), target))
    state = {**module.trainable_state(), "lm_head.weight": module.lm_head.weight}
    state["d2t"] = torch.full((40,), 500, dtype=torch.int64)
    folder = write(tmp_path / "d2t", llama_config(), {"model.safetensors": state})
    with pytest.raises(SpecrtError, match="d2t maps draft ids"):
        drafters.load(folder, target)

    del state["d2t"]
    folder = write(tmp_path / "nod2t", llama_config(), {"model.safetensors": state})
    with pytest.raises(SpecrtError, match=r"missing \['d2t'\]"):
        drafters.load(folder, target)

    del state["lm_head.weight"]
    folder = write(tmp_path / "nohead", llama_config(draft_vocab_size=40), {"model.safetensors": state})
    with pytest.raises(SpecrtError, match=r"model\.safetensors .*missing \[.*'lm_head\.weight'\]"):
        drafters.load(folder, target)

    # a full-vocabulary head needs no d2t
    module = randomized(drafters.build(drafters.make_config("eagle3", taps=[0, 1]), target))
    state = {k: v for k, v in module.trainable_state().items() if k != "d2t"}
    folder = write(tmp_path / "full", llama_config(), {"model.safetensors": {**state, "lm_head.weight": module.lm_head.weight}})
    loaded = drafters.load(folder, target)
    assert torch.equal(loaded.target_ids(), torch.arange(target.cfg.vocab_size))
    assert_same_steps(loaded, module)


# ---------------------------------------------------------------------------------------------- MTP


def mtp_folder(folder: Path, target, n: int = 2, extra: dict | None = None):
    module = randomized(drafters.build(drafters.make_config("mtp", num_modules=n), target))
    layers = target.cfg.num_layers
    mtp = {}
    for k, v in module.trainable_state().items():
        _, idx, rest = k.split(".", 2)
        mtp[f"model.layers.{layers + int(idx)}.{rest.removeprefix('block.')}"] = v
    for k in range(n):  # copies of the target's shared weights, ignored
        mtp[f"model.layers.{layers + k}.embed_tokens.weight"] = target.model.embed_tokens.weight
        mtp[f"model.layers.{layers + k}.shared_head.head.weight"] = target.lm_head.weight
    mtp.update(extra or {})
    base = {k: v for k, v in target.state_dict().items()}
    shards = {"model-00001-of-00002.safetensors": base, "model-00002-of-00002.safetensors": mtp}
    write(folder, llama_config(num_nextn_predict_layers=n), shards)
    weight_map = {k: name for name, state in shards.items() for k in state}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return module


def test_mtp_layout(tmp_path, target):
    module = mtp_folder(tmp_path / "mtp", target)
    assert "model.layers.2.enorm.weight" in json.loads((tmp_path / "mtp/model.safetensors.index.json").read_text())[
        "weight_map"]
    assert public.detect(tmp_path / "mtp") == "mtp"
    loaded = drafters.load(tmp_path / "mtp", target)
    assert loaded.cfg.num_modules == 2 and loaded.cfg.num_steps == 3
    for got, want in zip(loaded.mtp, module.mtp, strict=True):
        assert_same_steps(got, want)


def test_mtp_errors(tmp_path, target):
    moe = {"model.layers.2.mlp.experts.0.gate_proj.weight": torch.zeros(96, 64)}
    mtp_folder(tmp_path / "moe", target, extra=moe)
    with pytest.raises(SpecrtError, match="mixture-of-experts"):
        drafters.load(tmp_path / "moe", target)

    mtp_folder(tmp_path / "shard", target)
    (tmp_path / "shard/model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SpecrtError, match=r"model\.safetensors\.index\.json names shard model-00002-of-00002"):
        drafters.load(tmp_path / "shard", target)

    mtp_folder(tmp_path / "more", target, n=1)  # config says 1 module, keys hold layer 3 too
    cfg = json.loads((tmp_path / "more/config.json").read_text())
    (tmp_path / "more/config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 2}))
    with pytest.raises(SpecrtError, match=r"index\.json does not match a 2-module MTP.*model\.layers\.3\."):
        drafters.load(tmp_path / "more", target)


# ---------------------------------------------------------------------------------------------- detection


def test_detect_and_fallbacks(tmp_path, target):
    unrelated = write(tmp_path / "bert", {"model_type": "bert", "hidden_size": 64}, {})
    assert public.detect(unrelated) is None
    assert public.detect(write(tmp_path / "empty", None, {})) is None
    hf = write(tmp_path / "hf", llama_config(), {"model.safetensors": target.state_dict()})
    assert public.detect(hf) is None
    with pytest.raises(SpecrtError, match="neither a specrt drafter checkpoint"):
        drafters.load(unrelated, target)
    with pytest.raises(SpecrtError, match=r"config\.json is missing"):
        drafters.load(tmp_path / "empty", target)

    # no config.json at all: the layout is read from the weights
    module, _, files = medusa_files(target, heads=2, layers=1)
    folder = write(tmp_path / "bare", None, files)
    assert public.detect(folder) == "medusa"
    h = torch.randn(1, 2, 64)
    torch.testing.assert_close(drafters.load(folder, target)(h), module(h), rtol=0, atol=0)

    # a specrt checkpoint is still read by the native loader
    native = randomized(drafters.build(drafters.make_config("eagle"), target))
    drafters.save(native, tmp_path / "native")
    assert public.detect(tmp_path / "native") is None
    assert_same_steps(drafters.load(tmp_path / "native", target), native)


def test_eagle_layer_flags_come_from_the_checkpoint(tmp_path, target):
    """A Llama target with an EAGLE layer that has q/k/v biases (as for Qwen2 targets): read from its keys."""
    from dataclasses import replace

    from specrt.export.drafters.eagle import EagleConfig, EagleHead

    module = EagleHead(EagleConfig(), replace(target.cfg, qkv_bias=True))
    module.attach_target(target.model.embed_tokens.weight, target.lm_head.weight)
    randomized(module)
    folder = write(tmp_path / "bias", llama_config(), {"model.safetensors": module.trainable_state()})
    loaded = drafters.load(folder, target)
    assert loaded.dec.qkv_bias and not target.cfg.qkv_bias
    assert_same_steps(loaded, module)
