"""A bundle's int4 decoder graph read as the native pass's weights: what each initializer is, by the names
export/decoder_graph.py gives them, and what the native pass does not compute (refused, named).

The graph stays the source of truth: the native backend runs the same int4 weights (`MatMulNBits`, block 32,
symmetric) and the same norms, embedding and rotary frequencies as `--backend ort`; it computes them with its
own batch-invariant kernels (csrc/), so it is its own exactness reference, as each backend is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from specrt.engines.tables import EmbeddingTable, embedding_table, tensor_array
from specrt.errors import SpecrtError
from specrt.schema.config import DecoderConfig

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the C API's order (spn_set_linear `which`)


# weight formats of the kernels (csrc/w4a8.h Format): name -> the library's code
FORMATS = {"q4": 0, "q4_min": 1, "q8": 2, "q8x16": 3, "q8_min": 4, "q8x16_min": 5}


@dataclass
class Linear:
    k: int
    n: int
    q: np.ndarray  # q4, q4_min: uint8 [N, blocks, 16] (MatMulNBits' packing); the q8 formats: int8 [N, blocks, 32]
    scales: np.ndarray  # float32 [N, blocks]; q8x16, q8x16_min: [N, blocks, 2] (inputs 0..15, 16..31)
    bias: np.ndarray | None = None
    # q4: d·(q - 8); q4_min: d·q + m; q8: d·q; q8x16: d·q with a d per half block; q8_min: d·q + m (GGUF's
    # Q4_0, Q4_1 and Q4_K, Q8_0 and IQ4, Q6_K and Q3_K, Q5_1 and Q5_K blocks); q8x16_min: d·q + m per half block
    # (Q2_K, or a projection fused from rows of several of those types)
    format: str = "q4"
    mins: np.ndarray | None = None  # q4_min, q8_min: float32 [N, blocks]; q8x16_min: [N, blocks, 2]


@dataclass
class Weights:
    embed: EmbeddingTable  # [V, H]: float rows, or int8 blocks dequantized on lookup
    norms: list[tuple[np.ndarray, np.ndarray]]  # per layer: input, post-attention
    final_norm: np.ndarray
    layers: list[dict[str, Linear]]
    head: Linear
    taps: list[int] = field(default_factory=list)  # layers whose inputs are aux_hidden_states, in order


def unsupported(cfg: DecoderConfig) -> str:
    """What of `cfg` the native pass does not compute, as a phrase; "" when it computes it all."""
    checks = (
        (bool(cfg.qk_norm), "qk-norm"),
        (bool(cfg.sandwich_norms), "sandwich norms"),
        (any(cfg.layer_windows), "sliding-window layers"),
        (any(cfg.layer_rope), "per-layer RoPE tables"),
        (bool(cfg.attn_logit_softcapping), "attention softcapping"),
        (bool(cfg.final_logit_softcapping), "logit softcapping"),
        (cfg.activation != "silu", f"the {cfg.activation} activation"),
        (cfg.num_heads % cfg.num_kv_heads != 0, "query heads not a multiple of KV heads"),
        (cfg.head_dim % 2 != 0, "an odd head_dim"),
    )
    return ", ".join(why for bad, why in checks if bad)


def float_projections(model: onnx.ModelProto) -> list[str]:
    """The graph's float MatMul / Gemm nodes over a weight: what the native kernels do not run."""
    names = {t.name for t in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type in ("MatMul", "Gemm") and len(n.input) > 1
            and n.input[1] in names]


def decoder_unsupported(path: Path, cfg: DecoderConfig) -> str:
    """Why the decoder graph at `path` (a draft model) cannot run natively, as a phrase; "" when it can."""
    why = unsupported(cfg)
    if why:
        return f"it computes {why}"
    model = onnx.load(str(path), load_external_data=False)
    if float_projections(model):
        return "it has float projections (export it with --quantize int4)"
    if not any(n.op_type == "MatMulNBits" for n in model.graph.node):
        return "it has no int4 projections"
    return ""


def _nbits(node: onnx.NodeProto, inits: dict, path: Path) -> Linear:
    """A MatMulNBits node as the kernels' blocks: 4-bit symmetric (q4), 4-bit with float zero points (q4_min:
    a GGUF Q4_1's d·q + m, the minimum read back as -z·d) or 8-bit symmetric (q8), blocks of 32; or 8-bit
    symmetric in blocks of 16 over whole blocks of 32 (q8x16: a GGUF Q6_K's); 8-bit with an initializer
    `<weight>_mins` beside it (q8_min: a Q5_1 or Q5_K block's d·q + m, the minimums' term a node of its own)."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    bits, zp_name, size = attrs.get("bits"), node.input[3] if len(node.input) > 3 else "", attrs.get("block_size")
    zp = tensor_array(path, inits[zp_name]) if zp_name else None
    k, n = int(attrs["K"]), int(attrs["N"])
    halves = size == 16 and bits == 8 and zp is None and k % 32 == 0
    if (size != 32 and not halves) or bits not in (4, 8) or (zp is not None and (bits != 4 or zp.dtype != np.float32)):
        raise SpecrtError(f"{path}: {node.name} is {bits}-bit, block {size}"
                          f"{', with integer zero points' if zp is not None else ''}: the native backend runs blocks "
                          "of 32, 4-bit (symmetric or with float zero points) or 8-bit symmetric, and 8-bit symmetric "
                          "blocks of 16 in rows of whole 32s (`specrt export --quantize int4`); use --backend ort")
    blocks = (k + 31) // 32
    width = 16 if bits == 4 else 32
    per = 2 if halves else 1
    q, scales = tensor_array(path, inits[node.input[1]]), tensor_array(path, inits[node.input[2]])
    if q.size != n * blocks * width or scales.size != n * blocks * per or (zp is not None and zp.size != n * blocks):
        raise SpecrtError(f"{path}: {node.name} holds {q.size} weight bytes and {scales.size} scales where its K {k} "
                          f"and N {n} need {n * blocks * width} and {n * blocks * per}: export the bundle again")
    q = np.ascontiguousarray(q, np.uint8).reshape(n, blocks, width)
    scales = np.ascontiguousarray(scales, np.float32).reshape(n, blocks, per)
    mins = inits.get(node.input[1].rsplit("_", 1)[0] + "_mins")  # q8_min's, q8x16_min's (quantize.py min_term)
    if bits == 8 and mins is not None:
        mins = tensor_array(path, mins)
        if mins.shape != (blocks * per, n):
            raise SpecrtError(f"{path}: {node.name}'s minimums are {mins.shape}, not ({blocks * per}, {n}): export "
                              "the bundle again")
        mins = np.ascontiguousarray(mins.T, np.float32).reshape(n, blocks, per)
        return Linear(k, n, (q ^ np.uint8(0x80)).view(np.int8), scales if halves else scales[..., 0],
                      format="q8x16_min" if halves else "q8_min", mins=mins if halves else mins[..., 0])
    if bits == 8:
        return Linear(k, n, (q ^ np.uint8(0x80)).view(np.int8), scales if halves else scales[..., 0],
                      format="q8x16" if halves else "q8")
    scales = scales[..., 0]
    if zp is None:
        return Linear(k, n, q, scales)
    return Linear(k, n, q, scales, format="q4_min", mins=file_minimums((-zp.reshape(n, blocks) * scales).astype(np.float32)))


def file_minimums(mins: np.ndarray) -> np.ndarray:
    """A q4_min node's minimums, read back as -z·d: each within a float32 ulp of the model file's own m
    (export/quantize.py exact_zero_points). A GGUF Q4_1 block's m is a half, so where every one of them is that
    close to a half, the halves are the file's minimums exactly, and the library keeps them as halves (2 bytes
    each streamed). Elsewhere (Q4_K's dmin·m_j: not halves) they stay as read."""
    with np.errstate(over="ignore"):
        halves = mins.astype(np.float16).astype(np.float32)
    near = np.isfinite(halves) & (np.abs(mins - halves) <= np.spacing(np.abs(mins)))
    return halves if near.all() else mins


def int4_projection(path: Path, inits: dict, by_weight: dict, weight: str) -> Linear:
    """The int4 projection quantized from initializer `weight` (the quantizer names it `<weight>_Q4`);
    `by_weight`: the graph's MatMulNBits nodes by their weight input."""
    hits = [n for w, n in by_weight.items() if w.startswith(weight + "_")]
    if len(hits) != 1:
        raise SpecrtError(f"{path}: expected one int4 projection of {weight}, found {len(hits)}: export the "
                          "bundle again")
    return _nbits(hits[0], inits, path)


def _mismatch(path: Path, field: str, said, held, what: str) -> SpecrtError:
    return SpecrtError(f"manifest.json's target {field} is {said} but {path} holds {what} {held}: the manifest does not "
                       "describe its graph; restore manifest.json or export the bundle again")


def check_shapes(path: Path, cfg: DecoderConfig, w: Weights) -> None:
    """Every dimension of `cfg` against the shapes `w` really has, before any of it reaches the C side: a
    manifest edited or mismatched is named by its field, never run as a model of other shapes."""
    H, nq = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    nqkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    if min(cfg.num_layers, H, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
           cfg.vocab_size) < 1:
        raise SpecrtError(f"manifest.json's target config has a dimension below 1 ({cfg.num_layers} layers, hidden "
                          f"{H}, heads {cfg.num_heads}/{cfg.num_kv_heads}, head_dim {cfg.head_dim}, intermediate "
                          f"{cfg.intermediate_size}, vocab {cfg.vocab_size}): restore manifest.json")
    V, width = w.embed.shape
    if width != H:
        raise _mismatch(path, "hidden_size", H, f"{V} x {width}", "an embedding table of")
    if V != cfg.vocab_size:
        raise _mismatch(path, "vocab_size", cfg.vocab_size, f"{V} x {width}", "an embedding table of")
    if w.head.n != cfg.vocab_size or w.head.k != H:
        raise _mismatch(path, "vocab_size", cfg.vocab_size, f"{w.head.k} x {w.head.n}", "an LM head of")
    for i, ((ln1, ln2), p) in enumerate(zip(w.norms, w.layers, strict=True)):
        for norm in (ln1, ln2):
            if norm.size != H:
                raise _mismatch(path, "hidden_size", H, f"{norm.size} weights", f"layer {i}'s norm of")
        qkv, o, gu, down = (p[name] for name in PROJECTIONS)
        if qkv.k != H or o.n != H or gu.k != H or down.n != H:
            raise _mismatch(path, "hidden_size", H, f"{qkv.k} inputs", f"layer {i}'s q|k|v projection of")
        if qkv.n != nqkv or o.k != nq:
            raise _mismatch(path, "num_heads / num_kv_heads / head_dim",
                            f"{cfg.num_heads} / {cfg.num_kv_heads} / {cfg.head_dim} ({nqkv} q|k|v columns, {nq} "
                            "attention outputs)", f"{qkv.n} q|k|v columns and {o.k} attention outputs",
                            f"in layer {i}")
        if gu.n != 2 * cfg.intermediate_size or down.k != cfg.intermediate_size:
            raise _mismatch(path, "intermediate_size", cfg.intermediate_size, f"{down.k} inputs",
                            f"layer {i}'s down projection of")
    if w.final_norm.size != H:
        raise _mismatch(path, "hidden_size", H, f"{w.final_norm.size} weights", "a final norm of")


def read(path: Path, cfg: DecoderConfig) -> Weights:
    """The weights of the decoder graph at `path`, checked against what the native pass computes."""
    why = unsupported(cfg)
    if why:
        raise SpecrtError(f"the native backend does not compute {why} ({cfg.model_type}): use --backend ort")
    model = onnx.load(str(path), load_external_data=False)  # data mapped by tensor_array, not copied by onnx
    inits = {t.name: t for t in model.graph.initializer}

    def arr(name: str) -> np.ndarray:
        if name not in inits:
            raise SpecrtError(f"{path} has no initializer {name!r}: export the bundle again")
        return np.ascontiguousarray(tensor_array(path, inits[name]), np.float32)

    by_weight = {n.input[1]: n for n in model.graph.node if n.op_type == "MatMulNBits"}
    plain = float_projections(model)
    if plain or not by_weight:
        raise SpecrtError(f"{path} has float projections ({(plain or ['no MatMulNBits'])[0]}): the native backend "
                          "runs int4 bundles (`specrt export --quantize int4`); use --backend ort")

    def linear(weight: str, bias: str = "") -> Linear:
        lin = int4_projection(path, inits, by_weight, weight)
        if bias in inits:
            lin.bias = np.ascontiguousarray(arr(bias))
        return lin

    graph_layers = len({n.split(".")[2] for n in inits if n.startswith("model.layers.")
                        and n.endswith(".input_layernorm.weight")})
    if cfg.num_layers != graph_layers:
        raise _mismatch(path, "num_layers", cfg.num_layers, graph_layers, "layers:")
    layers, norms = [], []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        layers.append({name: linear(f"{p}.{name}.weight", f"{p}.{name}.bias") for name in PROJECTIONS})
        norms.append((arr(f"{p}.input_layernorm.weight"), arr(f"{p}.post_attention_layernorm.weight")))
    head = linear("model.embed_tokens.weight.T" if cfg.tie_word_embeddings else "lm_head.weight.T")
    # the inputs of the tapped layers, by the input norm that reads each one
    layer_of = {n.input[0]: int(n.input[1].split(".")[2]) for n in model.graph.node
                if n.op_type == "RMSNormalization" and n.input[1].endswith(".input_layernorm.weight")}
    producer = {o: n for n in model.graph.node for o in n.output}
    name = "aux_hidden_states"
    while name in producer and producer[name].op_type == "Identity":
        name = producer[name].input[0]
    taps = [layer_of[x] for x in producer[name].input] if name in producer else []
    if any(o.name == "aux_hidden_states" for o in model.graph.output) and not taps:
        raise SpecrtError(f"{path}: aux_hidden_states is not a Concat of layer inputs: export the bundle again")
    w = Weights(embedding_table(path, model), norms, arr("model.norm.weight"), layers, head, taps)
    if len(w.embed.shape) != 2:
        raise SpecrtError(f"{path}: model.embed_tokens.weight is not a table: export the bundle again")
    check_shapes(path, cfg, w)
    return w


def rope_tables(cfg: DecoderConfig, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [rows, d/2] at positions 0..rows-1: float32 positions times the float32 frequencies, as the
    graph's rotary nodes compute them, the cosine and sine taken in float64 (the same on every CPU)."""
    inv_freq, scaling = cfg.rope_table(0)
    freqs = np.arange(rows, dtype=np.float32)[:, None] * np.asarray(inv_freq, np.float32)[None, :]
    cos = np.cos(freqs.astype(np.float64)).astype(np.float32)
    sin = np.sin(freqs.astype(np.float64)).astype(np.float32)
    if scaling != 1.0:
        cos, sin = cos * np.float32(scaling), sin * np.float32(scaling)
    return np.ascontiguousarray(cos), np.ascontiguousarray(sin)
