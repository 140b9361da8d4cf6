"""A GGUF file's quantized weights as the blocks they are, for kernels that compute them without rounding
them again (engines/native/csrc/w4a8.h formats; ONNX Runtime's MatMulNBits).

    GGUF type   its block                                     format   the value of input i
    Q4_0        32 inputs: d fp16, 16 bytes of nibbles        q4       d·(q_i - 8)
    Q4_1        32: d, m fp16, 16 bytes of nibbles            q4_min   d·q_i + m
    Q8_0        32: d fp16, 32 int8                           q8       d·q_i
    Q5_0        32: d fp16, 32 high bits, 16 bytes of nibbles q8       d·(q_i - 16), q_i - 16 as int8
    Q4_K        256: d, dmin fp16, 8 6-bit scales and mins,   q4_min   per 32: (d·sc_j)·q_i - dmin·m_j
                128 bytes of nibbles
    Q6_K        256: 6-bit codes (4 + 2 bits), 16 int8        q8x16    per 16: (d·sc_j)·(q_i - 32)
                scales, d fp16
    Q5_1        32: d, m fp16, 32 high bits, 16 bytes of      q8_min   d·q_i + m, the 5-bit q_i as int8
                nibbles
    Q5_K        256: d, dmin fp16, Q4_K's scales and mins,    q8_min   per 32: (d·sc_j)·q_i - dmin·m_j
                32 bytes of high bits, 128 of nibbles
    Q3_K        256: 32 bytes of high bits, 64 of 2-bit       q8x16    per 16: (d·(sc_j - 32))·q_i, q_i in -4..3
                codes, 12 of 6-bit scales, d fp16
    Q2_K        256: 16 bytes of 4-bit scales and mins, 64    q8x16_min per 16: (d·sc_j)·q_i - dmin·m_j, q_i 0..3
                of 2-bit codes, d, dmin fp16
    IQ4_NL      32: d fp16, 16 bytes of nibbles               q8       d·v[q_i], v llama.cpp's 16 int8 levels
    IQ4_XS      256: d fp16, 8 6-bit scales (2 + 4 bytes),    q8       per 32: (d·(sc_j - 32))·v[q_i]
                128 bytes of nibbles

Q2_K and Q3_K codes held as int8 take 3-4× their file's bytes, and IQ4's twice: exact, not small.

A projection fused from tensors of different types (q|k|v, gate|up) is carried as q8x16_min: int8 codes
with a scale and a minimum per 16 inputs, which holds every type above exactly (`Blocks.halves_with_mins`).

A K-quant's (and IQ4_XS's) products d·sc_j and dmin·m_j are exact in float32 (an fp16 times a 6- or 8-bit integer), so its
sub-blocks are blocks of the formats above with float32 scales and minimums, and `Blocks.dense()` is bitwise
what gguf-py (and transformers with it) dequantizes. `q8x16` is an int8 block of 32 inputs with a scale for
each half (Q6_K's 16-input sub-blocks); `q8_min` an int8 block with a minimum (5-bit codes with one).

ggml keeps inputs 0..15 of a Q4_0/Q4_1 block in the low nibbles of its 16 bytes and 16..31 in the high ones
(Q4_K: sub-block 2j in the low nibbles of 32 bytes, 2j+1 in the high ones); MatMulNBits (and `Blocks.q`)
keeps input 2j in the low nibble of byte j and 2j+1 in the high one, so the nibbles are reordered, never
recomputed. llama.cpp's converter permutes the rows of q_proj and k_proj (its rotary layout); transformers
undoes that when it loads a GGUF, and `read_blocks` reorders the same rows, so a block here is the block of
the weight row transformers gives. Other types are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError

BLOCK = 32
# the graph's LM head weight (export/quantize.py untie_head): tied to the embedding, or its own
HEAD_WEIGHTS = ("model.embed_tokens.weight.T", "lm_head.weight.T")
TABLE_WEIGHT = "model.embed_tokens.weight"  # the graph's embedding table (carried when its blocks are int8)
INT8_FORMATS = ("q8", "q8x16", "q8_min", "q8x16_min")  # the formats whose codes are int8 (the rest: int4 nibbles)
HALVES = ("q8x16", "q8x16_min")  # the formats with a scale per 16 inputs


@dataclass
class Blocks:
    """Weight rows [N, K] as blocks of 32 inputs: q4 / q4_min q uint8 [N, blocks, 16] (MatMulNBits' packing),
    q8 / q8x16 / q8_min / q8x16_min q int8 [N, blocks, 32]; scales (and q4_min's and q8_min's mins) float32
    [N, blocks] (q8x16, and q8x16_min's scales and mins: [N, blocks, 2], inputs 0..15 and 16..31)."""

    format: str
    k: int
    q: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None = None

    @property
    def n(self) -> int:
        return self.q.shape[0]

    def codes(self) -> np.ndarray:
        """Each input's integer code, [N, blocks, 32] (q4: 0..15, q8: -128..127)."""
        if self.format in INT8_FORMATS:
            return self.q.astype(np.int32)
        codes = np.empty((*self.q.shape[:2], BLOCK), np.int32)
        codes[..., 0::2] = self.q & 15
        codes[..., 1::2] = self.q >> 4
        return codes

    def dense(self) -> np.ndarray:
        """The weights [N, K] in float32, computed as gguf-py dequantizes them (and transformers with it)."""
        c = self.codes().astype(np.float32)
        d = np.repeat(self.scales, BLOCK // 2, axis=-1) if self.format in HALVES else self.scales[..., None]
        if self.format == "q4":
            w = d * (c - np.float32(8))
        elif self.format in ("q4_min", "q8_min"):
            w = d * c + self.mins[..., None]
        elif self.format == "q8x16_min":
            w = d * c + np.repeat(self.mins, BLOCK // 2, axis=-1)
        else:
            w = c * d
        return w.reshape(self.n, -1)[:, : self.k]

    def halves_with_mins(self) -> Blocks:
        """These blocks as q8x16_min, exactly: int8 codes (q4's less 8), a scale and a minimum per 16 inputs
        (each half of a 32-input block keeps its block's; q8x16's halves their own, minimums 0), so that rows of
        different types fused into one projection share one format."""
        codes = self.codes() - (8 if self.format == "q4" else 0)
        two = self.scales if self.format == "q8x16" else np.stack([self.scales, self.scales], axis=-1)
        mins = np.zeros_like(two) if self.mins is None else np.stack([self.mins, self.mins], axis=-1)
        return Blocks("q8x16_min", self.k, codes.astype(np.int8), np.ascontiguousarray(two, np.float32),
                      np.ascontiguousarray(mins, np.float32))

    def take_rows(self, order: np.ndarray) -> Blocks:
        return Blocks(self.format, self.k, self.q[order], self.scales[order],
                      None if self.mins is None else self.mins[order])

    @staticmethod
    def stack(parts: list[Blocks]) -> Blocks:
        """The rows of `parts` one after another (q|k|v, gate|up): one projection of one format."""
        kinds = {(p.format, p.k) for p in parts}
        if len(kinds) != 1:
            raise SpecrtError(f"projections fused into one hold blocks of different types or widths {sorted(kinds)}")
        mins = None if parts[0].mins is None else np.concatenate([p.mins for p in parts])
        return Blocks(parts[0].format, parts[0].k, np.concatenate([p.q for p in parts]),
                      np.concatenate([p.scales for p in parts]), mins)


def _fp16(raw: np.ndarray) -> np.ndarray:
    """The fp16 number in the last axis' two bytes, as float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Codes [..., 32] (0..15) in MatMulNBits' order: input 2j in the low nibble of byte j."""
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4), np.uint8)


def _legacy(fmt: str):
    def parse(raw: np.ndarray, n: int, k: int) -> Blocks:
        d = _fp16(raw[..., 0:2])
        if fmt == "q8":
            return Blocks(fmt, k, raw[..., 2:].copy().view(np.int8), d)
        body = raw[..., 4:] if fmt == "q4_min" else raw[..., 2:]
        codes = np.concatenate([body & 15, body >> 4], axis=-1)  # ggml: inputs 0..15 low, 16..31 high
        return Blocks(fmt, k, _pack_nibbles(codes), d, _fp16(raw[..., 2:4]) if fmt == "q4_min" else None)

    return parse


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of 6-bit scales and minimums: 8 of each. Sub-blocks 0..3 keep theirs in the low 6
    bits of bytes 0..3 (scales) and 4..7 (minimums); 4..7 keep their low 4 bits in the nibbles of bytes 8..11
    and their high 2 bits in the top bits of bytes 0..3 and 4..7."""
    s = s.astype(np.uint8)
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """A legacy 5-bit block's codes 0..31 [..., 32] from its 4 bytes of fifth bits (bit i: input i's) and 16 of
    nibbles (inputs 0..15 low, 16..31 high)."""
    high = (qh.copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
    low = np.concatenate([qs & 15, qs >> 4], axis=-1)
    return low | (high.astype(np.uint8) << 4)


def _q5_0(raw: np.ndarray, n: int, k: int) -> Blocks:
    q = (_five_bits(raw[..., 2:6], raw[..., 6:]).astype(np.int16) - 16).astype(np.int8)
    return Blocks("q8", k, q, _fp16(raw[..., 0:2]))


def _q4_k(raw: np.ndarray, n: int, k: int) -> Blocks:
    d, dmin = _fp16(raw[..., 0:2])[..., None], _fp16(raw[..., 2:4])[..., None]
    sc, mn = _k_scales(raw[..., 4:16])
    qs = raw[..., 16:].reshape(n, -1, 4, 32)  # four 32-byte chunks: sub-block 2j low nibbles, 2j+1 high
    codes = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, -1, BLOCK)
    return Blocks("q4_min", k, _pack_nibbles(codes), (d * sc).reshape(n, -1), (-(dmin * mn)).reshape(n, -1))


def _q6_k(raw: np.ndarray, n: int, k: int) -> Blocks:
    ql = raw[..., 0:128].reshape(n, -1, 2, 64)  # per 128 inputs: 64 bytes of low 4 bits ...
    qh = raw[..., 128:192].reshape(n, -1, 2, 32)  # ... and 32 bytes of high 2 bits, four inputs a byte
    low = np.concatenate([ql & 15, ql >> 4], axis=-1)
    high = np.concatenate([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1)
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, -1, BLOCK)
    scales = raw[..., 192:208].copy().view(np.int8).astype(np.float32) * _fp16(raw[..., 208:210])[..., None]
    return Blocks("q8x16", k, q, scales.reshape(n, -1, 2))


def _q5_1(raw: np.ndarray, n: int, k: int) -> Blocks:
    q = _five_bits(raw[..., 4:8], raw[..., 8:]).astype(np.int8)
    return Blocks("q8_min", k, q, _fp16(raw[..., 0:2]), _fp16(raw[..., 2:4]))


def _q5_k(raw: np.ndarray, n: int, k: int) -> Blocks:
    d, dmin = _fp16(raw[..., 0:2])[..., None], _fp16(raw[..., 2:4])[..., None]
    sc, mn = _k_scales(raw[..., 4:16])
    qs = raw[..., 48:].reshape(n, -1, 4, 32)  # four 32-byte chunks: sub-block 2j low nibbles, 2j+1 high (Q4_K's)
    low = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, -1, 8, BLOCK)
    high = (raw[..., 16:48][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # sub-block j: bit j
    q = (low | (high << 4)).astype(np.int8).reshape(n, -1, BLOCK)
    return Blocks("q8_min", k, q, (d * sc).reshape(n, -1), (-(dmin * mn)).reshape(n, -1))


def _q3_k(raw: np.ndarray, n: int, k: int) -> Blocks:
    """Per 128 inputs, 32 bytes of 2-bit codes (input 32·s + i: bits 2s of byte i) and, for all 256, 32 bytes
    of high bits (input 32·b + i: bit b of byte i; a clear bit subtracts 4)."""
    low = (raw[..., 32:96].reshape(n, -1, 2, 1, 32) >> np.arange(0, 8, 2, dtype=np.uint8)[:, None]) & 3
    high = (raw[..., 0:32].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    q = low.reshape(n, -1, 256).astype(np.int8) - ((high.reshape(n, -1, 256) ^ 1) << 2).astype(np.int8)
    lo, hi = raw[..., 96:104], raw[..., 104:108]  # scale j: nibble j // 8 of byte j % 8, 2 bits of byte 8 + j % 4
    sc = np.concatenate([lo & 15, lo >> 4], axis=-1) | (
        ((hi[..., None, :] >> np.arange(0, 8, 2, dtype=np.uint8)[:, None]) & 3).reshape(n, -1, 16) << 4)
    scales = _fp16(raw[..., 108:110])[..., None] * (sc.astype(np.float32) - np.float32(32))
    return Blocks("q8x16", k, q.reshape(n, -1, BLOCK), scales.reshape(n, -1, 2))


def _q2_k(raw: np.ndarray, n: int, k: int) -> Blocks:
    """Per 128 inputs, 32 bytes of 2-bit codes (input 32·s + i: bits 2s of byte i); sub-block j's scale in
    the low nibble of byte j, its minimum in the high one."""
    q = (raw[..., 16:80].reshape(n, -1, 2, 1, 32) >> np.arange(0, 8, 2, dtype=np.uint8)[:, None]) & 3
    sc, d, dmin = raw[..., 0:16], _fp16(raw[..., 80:82])[..., None], _fp16(raw[..., 82:84])[..., None]
    return Blocks("q8x16_min", k, q.astype(np.int8).reshape(n, -1, BLOCK),
                  (d * (sc & 15).astype(np.float32)).reshape(n, -1, 2),
                  (-(dmin * (sc >> 4).astype(np.float32))).reshape(n, -1, 2))


IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def _iq4_nl(raw: np.ndarray, n: int, k: int) -> Blocks:
    body = raw[..., 2:]  # inputs 0..15 in the low nibbles, 16..31 in the high ones
    return Blocks("q8", k, IQ4_LEVELS[np.concatenate([body & 15, body >> 4], axis=-1)], _fp16(raw[..., 0:2]))


def _iq4_xs(raw: np.ndarray, n: int, k: int) -> Blocks:
    """Sub-block j's 6-bit scale: the nibble j % 2 of byte 4 + j // 2, and bits 2j of the uint16 at byte 2."""
    lo = raw[..., 4:8]
    low = np.stack([lo & 15, lo >> 4], axis=-1).reshape(n, -1, 8)
    high = (raw[..., 2:4].copy().view("<u2") >> np.arange(0, 16, 2, dtype=np.uint16)) & 3
    sc = (low | (high.astype(np.uint8) << 4)).astype(np.float32) - np.float32(32)
    body = raw[..., 8:].reshape(n, -1, 8, 16)  # sub-block j: 16 bytes, inputs 0..15 low nibbles, 16..31 high
    q = IQ4_LEVELS[np.concatenate([body & 15, body >> 4], axis=-1)]
    return Blocks("q8", k, q.reshape(n, -1, BLOCK), (_fp16(raw[..., 0:2])[..., None] * sc).reshape(n, -1))


@dataclass(frozen=True)
class GGMLType:
    format: str
    inputs: int  # per block (a K-quant's super-block)
    bytes: int
    parse: Callable[[np.ndarray, int, int], Blocks]


TYPES = {
    "Q4_0": GGMLType("q4", 32, 18, _legacy("q4")),
    "Q4_1": GGMLType("q4_min", 32, 20, _legacy("q4_min")),
    "Q8_0": GGMLType("q8", 32, 34, _legacy("q8")),
    "Q5_0": GGMLType("q8", 32, 22, _q5_0),
    "Q4_K": GGMLType("q4_min", 256, 144, _q4_k),
    "Q6_K": GGMLType("q8x16", 256, 210, _q6_k),
    "Q5_1": GGMLType("q8_min", 32, 24, _q5_1),
    "Q5_K": GGMLType("q8_min", 256, 176, _q5_k),
    "Q3_K": GGMLType("q8x16", 256, 110, _q3_k),
    "Q2_K": GGMLType("q8x16_min", 256, 84, _q2_k),
    "IQ4_NL": GGMLType("q8", 32, 18, _iq4_nl),
    "IQ4_XS": GGMLType("q8", 256, 136, _iq4_xs),
}


def _parse(type_name: str, raw: np.ndarray, n: int, k: int) -> Blocks:
    t = TYPES[type_name]
    raw = np.ascontiguousarray(raw, np.uint8).reshape(n, k // t.inputs, t.bytes)
    return t.parse(raw, n, k)


MAPPED_ARCH = "llama"  # the one GGUF architecture whose rows (q/k permutation, tensor names) are mapped here
FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})  # quantized by an int4 export, not quantized again
REQUANTIZE = "export with --requantize to quantize them again into int4 blocks (lossy: docs/quality.md)"


def refuse_requantizing(path: Path) -> None:
    """Refuse, before anything is loaded, a GGUF whose quantized blocks an int4 export could not carry as they
    are (a type outside TYPES, or an architecture whose rows are not mapped here), naming them and the fix."""
    g = GGUFBlocks(path)
    quantized = {name: kind for name in g.tensors if (kind := g.type_of(name)) not in FLOAT_TYPES}
    arch = g.field("general.architecture")
    if quantized and arch != MAPPED_ARCH:
        raise SpecrtError(f"{g.path}: quantized blocks are carried as they are only from llama-architecture GGUF "
                          f"files, and this one is {arch}; {REQUANTIZE}")
    other = {name: kind for name, kind in quantized.items() if kind not in TYPES}
    if other:
        shown = ", ".join(f"{name} ({kind})" for name, kind in list(other.items())[:3])
        raise SpecrtError(f"{g.path}: {len(other)} tensors are of types specrt cannot carry exactly: {shown}"
                          f"{', ...' if len(other) > 3 else ''}; it carries {', '.join(TYPES)}; {REQUANTIZE}")


def rotary_rows(n_rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's q/k permutation for `heads` heads (transformers'
    `_reverse_permute_weights` applied to row indices)."""
    half = n_rows // heads // 2
    return np.arange(n_rows).reshape(heads, half, 2).swapaxes(2, 1).reshape(-1)


class GGUFBlocks:
    """The block-quantized tensors of one GGUF file, by tensor name."""

    def __init__(self, path: Path):
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            self.reader = GGUFReader(str(self.path))
        except (OSError, ValueError) as e:
            raise SpecrtError(f"{self.path} could not be read as GGUF ({e}): the file is corrupt") from None
        self.tensors = {t.name: t for t in self.reader.tensors}

    def field(self, key: str):
        """A metadata value: a string, or a number; None when the file lacks it."""
        from gguf import GGUFValueType

        f = self.reader.fields.get(key)
        if f is None:
            return None
        part = f.parts[f.data[0]]
        return bytes(part).decode("utf-8") if f.types[0] == GGUFValueType.STRING else part[0]

    def type_of(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def has(self, name: str) -> bool:
        return name in self.tensors and self.type_of(name) in TYPES

    def read(self, name: str, heads: int | None = None) -> Blocks:
        """Tensor `name` as blocks (rows reordered for a rotary projection of `heads` heads)."""
        if name not in self.tensors:
            raise SpecrtError(f"{self.path} has no tensor {name!r}")
        t = self.tensors[name]
        kind = t.tensor_type.name
        if kind not in TYPES:
            raise SpecrtError(f"{self.path}: {name} is {kind}; the blocks carried as they are are "
                              f"{', '.join(TYPES)} (other types are dequantized and quantized again)")
        k, n = (int(x) for x in t.shape[:2])
        if k % TYPES[kind].inputs:
            raise SpecrtError(f"{self.path}: {name} has rows of {k} inputs, not whole {kind} blocks of "
                              f"{TYPES[kind].inputs}")
        blocks = _parse(kind, t.data, n, k)
        return blocks if heads is None else blocks.take_rows(rotary_rows(n, heads))


def projection_blocks(path: Path, cfg) -> dict[str, Blocks]:
    """The exported decoder graph's projection weights (export/decoder_graph.py names: the layers' qkv_proj,
    o_proj, gate_up_proj, down_proj, the LM head, and the embedding table where its blocks are int8) as the GGUF
    at `path` holds them, each scaled as the graph
    folds it (1/√d into q). Only a llama-architecture GGUF is mapped (its q/k row order is the one undone
    here); {} otherwise, and for any projection whose tensors are not all of TYPES (quantized again)."""
    g = GGUFBlocks(path)
    if g.field("general.architecture") != MAPPED_ARCH or cfg.qk_norm:
        return {}
    out = {}
    nh, kvh = cfg.num_heads, cfg.num_kv_heads
    for i in range(cfg.num_layers):
        b, p = f"blk.{i}", f"model.layers.{i}"
        parts = {
            "qkv_proj": [(f"{b}.attn_q.weight", nh, cfg.attn_scale), (f"{b}.attn_k.weight", kvh, 1.0),
                         (f"{b}.attn_v.weight", None, 1.0)],
            "o_proj": [(f"{b}.attn_output.weight", None, 1.0)],
            "gate_up_proj": [(f"{b}.ffn_gate.weight", None, 1.0), (f"{b}.ffn_up.weight", None, 1.0)],
            "down_proj": [(f"{b}.ffn_down.weight", None, 1.0)],
        }
        for proj, tensors in parts.items():
            if all(g.has(name) for name, _, _ in tensors):
                rows = [_scaled(g.read(name, heads), s) for name, heads, s in tensors]
                if len({r.format for r in rows}) > 1:  # fused rows of several types (Q4_K q|k with a Q6_K v)
                    rows = [r.halves_with_mins() for r in rows]
                out[f"{p}.{proj}.weight"] = Blocks.stack(rows)
    table = g.read("token_embd.weight") if g.has("token_embd.weight") else None  # export/quantize.py carries
    if table is not None:  # it where its blocks are a format a table lookup takes (TABLE_FORMATS)
        out[TABLE_WEIGHT] = table
    if "output.weight" not in g.tensors and table is not None:  # tied: the head is the table's blocks
        out[HEAD_WEIGHTS[0]] = table
    elif g.has("output.weight"):
        out[HEAD_WEIGHTS[1]] = g.read("output.weight")
    return out


def _scaled(b: Blocks, scale: float) -> Blocks:
    if scale == 1.0:
        return b
    s = np.float32(scale)
    return Blocks(b.format, b.k, b.q, b.scales * s, None if b.mins is None else b.mins * s)
