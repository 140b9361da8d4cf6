"""Shared builders for tests: tiny random models of every supported family, tiny bundles."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)

# One tiny config per supported family; tests/export/test_modeling_parity.py fails if a family lacks one.
FAMILY_OVERRIDES = {
    "llama": dict(attention_bias=False),
    "mistral": dict(sliding_window=None),
    "qwen2": dict(),
    "qwen3": dict(head_dim=16),
    "phi3": dict(pad_token_id=None, bos_token_id=None, eos_token_id=None),
    # Gemma: tied embeddings (its default); a q·k scale base other than head_dim; caps small enough to bite
    "gemma": dict(head_dim=16, tie_word_embeddings=True),
    "gemma2": dict(head_dim=16, tie_word_embeddings=True, query_pre_attn_scalar=24, attn_logit_softcapping=0.5,
                   final_logit_softcapping=2.0),
    "gemma3_text": dict(head_dim=16, tie_word_embeddings=True, query_pre_attn_scalar=24, final_logit_softcapping=2.0,
                        layer_types=["sliding_attention", "full_attention"]),
}


def share_native_kernels(home: Path) -> Path:
    """Make `home` (a fresh $SPECRT_HOME) find this checkout's compiled native kernels: its cache/native links to
    the current home's, built first if need be. A test of an empty home then does not compile them again (~40 s
    on two cores); the compile itself is tested in tests/engines/test_native_failsafe.py."""
    from specrt.engines.native import library
    from specrt.errors import SpecrtError

    try:
        built = library.build().parent.parent  # <home>/cache/native
    except SpecrtError:  # no compiler here (or no writable cache): nothing to share, the home stays empty
        return home
    (home / "cache").mkdir(parents=True, exist_ok=True)
    (home / "cache" / "native").symlink_to(built, target_is_directory=True)
    return home


def tiny_hf_model(model_type: str, seed: int = 0, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{**TINY, **FAMILY_OVERRIDES[model_type], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random norms and biases so that a wrong placement cannot hide
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def save_tiny_folder(folder: Path, model_type: str, tokenizer_dir: Path | None, seed: int = 0, **overrides) -> Path:
    """A Hugging Face folder (config + safetensors + tokenizer files) with a tiny random model."""
    model = tiny_hf_model(model_type, seed, **overrides)
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, folder / f.name)
    return folder


def random_drafters() -> dict[str, dict]:
    """{kind: config fields} of the random drafters tests run on a tiny target (tests/conftest.py
    random_drafters_bundle): every learned kind exported as a drafter (not as a bundle role), with its
    spec's `random_config` (else `example_config`), in listing order."""
    from specrt.kinds import kinds

    return {s.name: dict(s.example_config if s.random_config is None else s.random_config)
            for s in kinds().values() if s.learned and not s.bundle_role}


HEAD_VOCAB = 3000  # draft-vocabulary size of random drafters' heads (kinds with `Training.head_vocab`)


def save_random_drafters(folder: Path, target, specs: dict[str, dict]) -> list[tuple[str, Path]]:
    """Drafters of each kind in `specs` ({kind: config fields}) for the loaded `target`, with random
    non-trivial weights (one seeded stream, so the same call gives the same weights), saved as
    checkpoints under folder/<kind>; each reduced draft vocabulary (EAGLE-3's and block's, the heads of
    the kinds that keep one) is spread over the target's."""
    from specrt.export import drafters
    from specrt.export.drafters import kind_spec

    gen, saved = torch.Generator().manual_seed(0), []
    vocab = target.module.cfg.vocab_size
    for kind, fields in specs.items():
        m = drafters.build(drafters.make_config(kind, **fields), target.module)
        with torch.no_grad():
            for p in m.parameters():
                if p.requires_grad:
                    p.add_(0.3 * torch.randn(p.shape, generator=gen))
            if hasattr(m, "d2t"):  # a reduced draft vocabulary (EAGLE-3, block)
                n = m.cfg.draft_vocab_size
                m.d2t.copy_(torch.randperm(vocab, generator=gen)[:n].sort().values - torch.arange(n))
        if kind_spec(kind).training.head_vocab:  # a head over a draft vocabulary (EAGLE, MTP, Medusa)
            m.set_head_vocab(torch.randperm(vocab, generator=gen)[:HEAD_VOCAB].sort().values)
        drafters.save(m.eval(), folder / kind)
        saved.append((kind, folder / kind))
    return saved


def random_drafter_bundle(tmp: Path, tokenizer_dir: Path, specs: dict[str, dict], draft_layers: int | None):
    """A tiny random Llama (real tokenizer, vocab 49152) exported with `save_random_drafters(specs)`:
    (bundle, loaded target, [(kind, checkpoint folder)])."""
    from specrt.export.bundle import ExportOptions, export_bundle
    from specrt.export.loading import load_model

    folder = save_tiny_folder(tmp / "llama", "llama", tokenizer_dir, vocab_size=49152, max_position_embeddings=256)
    target = load_model(folder, keep_hf=False)
    requested = save_random_drafters(tmp, target, specs)
    export_bundle(target, tmp / "bundle", ExportOptions(draft_layers=draft_layers, progress=False,
                                                        drafters=tuple(requested)))
    return tmp / "bundle", target, requested


def save_word_tokenizer(folder: Path, vocab_size: int) -> Path:
    """A fast word-level tokenizer (`t0` .. `t{vocab_size-1}`, no special tokens) for tiny random models,
    so a test exports a bundle without the real model's tokenizer. Load it with PreTrainedTokenizerFast:
    AutoTokenizer beside a Qwen config picks Qwen2Tokenizer, which adds a special token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
    return folder


def built_copy(bundle: Path, dest: Path) -> Path:
    """`dest`: a copy of `bundle` after `specrt build`'s ONNX Runtime step (it writes the ort-fused graphs)."""
    from specrt.engines.ort_cpu.build import build_ort
    from specrt.schema.manifest import Manifest

    shutil.copytree(bundle, dest)
    manifest = Manifest.load(dest)
    manifest.artifacts["onnxruntime"] = build_ort(dest, manifest, threads=1)
    manifest.save(dest)
    return dest


def export_tiny(tmp: Path, family: str, quantize: str | None = "int4", **overrides) -> Path:
    """A tiny random `family` model (word tokenizer, vocab 128) exported as a bundle with no drafter,
    `quantize`d (int4 by default: what the native backend runs); `tmp / "bundle"`."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from specrt.export.bundle import ExportOptions, export_bundle
    from specrt.export.loading import LoadedModel, module_from_hf

    tokenizer = save_word_tokenizer(tmp / "tokenizer", TINY["vocab_size"])
    folder = save_tiny_folder(tmp / family, family, None, seed=5, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    loaded = LoadedModel(module=module_from_hf(hf), tokenizer=PreTrainedTokenizerFast.from_pretrained(tokenizer),
                         source=str(folder), hf_config=hf.config)
    out = tmp / "bundle"
    export_bundle(loaded, out, ExportOptions(draft_layers=0, progress=False, quantize=quantize))
    return out


def eventually(probe, timeout: float = 30.0, every: float = 0.01):
    """`probe()`'s first truthy value, asked every `every` seconds until `timeout` seconds have passed
    (then its last value, falsy). For a wait on something that is bound to happen: the deadline is far
    beyond the time it takes on any machine, so a verdict never depends on the machine's speed."""
    deadline = time.monotonic() + timeout
    while not (value := probe()) and time.monotonic() < deadline:
        time.sleep(every)
    return value


def raw_k_blocks(rng, kind: str, rows: int, k: int, scale: float = 0.01):
    """Random GGUF `kind` blocks (a K-quant's or IQ4's) for `rows` rows of `k` inputs, as the bytes a file holds:
    any bytes are a valid block but for its fp16 factors (d, and Q2_K's, Q4_K's and Q5_K's dmin), drawn in
    [scale/100, scale]."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    inputs, size = GGML_QUANT_SIZES[T[kind]]
    raw = rng.integers(0, 256, (rows, k // inputs, size), dtype=np.uint8)
    for off in {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82),
                "IQ4_NL": (0,), "IQ4_XS": (0,)}[kind]:
        d = (rng.random(raw.shape[:2]) * 0.99 * scale + scale / 100).astype(np.float16)
        raw[..., off:off + 2] = d[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def _first_tokens(reader, n: int) -> dict:
    """The tokenizer fields of a GGUF cut to its first `n` tokens, with the merges whose parts and result are
    among them, and the vocab_size that says so."""
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()[:n]
    known = set(tokens)
    out = {"llama.vocab_size": n, "tokenizer.ggml.tokens": tokens,
           "tokenizer.ggml.merges": [m for m in reader.fields["tokenizer.ggml.merges"].contents()
                                     if all(p in known for p in m.split(" ")) and m.replace(" ", "") in known]}
    for name in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if name in reader.fields:
            out[name] = reader.fields[name].contents()[:n]
    return out


def k_quant_gguf(path: Path, source: Path, seed: int = 0, main: str = "Q4_K", layer1: str | None = None,
                 table: str = "Q6_K", vocab_size: int | None = None) -> Path:
    """A 2-layer Llama GGUF typed as llama.cpp's Q4_K_M types one (`main` Q5_1: its 5-bit blocks with a minimum,
    quantized by gguf-py from normal weights, where random K-quant bytes would be far off centre): `main`
    projections, Q6_K embedding (tied head) and Q6_K attn_v / ffn_down in layer 0 (`main` in layer 1), random
    blocks; the metadata and tokenizer of the GGUF at `source` (hidden 256, 4 heads of 64, 2 KV heads, ffn 512:
    whole 256-input super-blocks). `layer1` types layer 1's projections in place of `main`, `table` the embedding.
    `vocab_size` keeps the source's first tokens only, and the merges among them: a BPE vocabulary that parses
    in a fraction of the time (transformers reads the header several times over).
    """
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    dims = {"block_count": 2, "embedding_length": 256, "feed_forward_length": 512, "attention.head_count": 4,
            "attention.head_count_kv": 2, "rope.dimension_count": 64, "context_length": 512}
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(path), "llama")
    kept = _first_tokens(reader, vocab_size) if vocab_size else {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        key = name.removeprefix("llama.")
        value = dims.get(key, field.contents()) if name.startswith("llama.") else field.contents()
        value = kept.get(name, value)
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub)
    rng = np.random.default_rng(seed)
    h, ffn, vocab = 256, 512, vocab_size or int(reader.fields["llama.vocab_size"].contents())

    def quant(name: str, kind: str, rows: int, k: int):
        if kind == "Q5_1":  # a legacy type gguf-py quantizes: blocks of real (centered) weights
            raw = quants.quantize((rng.standard_normal((rows, k)) * 0.05).astype(np.float32), T[kind])
        else:
            low = {"Q4_K": 3e-4, "Q3_K": 1e-3, "Q2_K": 1e-3}  # d that gives weights of ~0.01-0.1, as Q6_K's 3e-5
            raw = raw_k_blocks(rng, kind, rows, k, 1e-4 if name.startswith("token") else low.get(kind, 3e-5))
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=T[kind])

    quant("token_embd.weight", table, vocab, h)
    for i in range(2):
        own = main if i == 0 else layer1 or main
        six = "Q6_K" if i == 0 else own
        for short, rows, k, kind in (("attn_q", h, h, own), ("attn_k", 128, h, own), ("attn_v", 128, h, six),
                                     ("attn_output", h, h, own), ("ffn_gate", ffn, h, own),
                                     ("ffn_up", ffn, h, own), ("ffn_down", h, ffn, six)):
            quant(f"blk.{i}.{short}.weight", kind, rows, k)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(h)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(h, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
