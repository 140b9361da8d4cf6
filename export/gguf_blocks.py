"""A GGUF file's quantized weights as the blocks they are, for kernels that compute them without rounding
them again (engines/native/csrc/w4a8.h formats; ONNX Runtime's MatMulNBits).

    GGUF type   block (32 inputs of one output row)          format   the value of input i
    Q4_0        d fp16, 16 bytes of nibbles                  q4       d·(q_i - 8)
    Q4_1        d fp16, m fp16, 16 bytes of nibbles          q4_min   d·q_i + m
    Q8_0        d fp16, 32 int8                              q8       d·q_i

ggml keeps inputs 0..15 of a block in the low nibbles of its 16 bytes and 16..31 in the high ones;
MatMulNBits (and `Blocks.q`) keeps input 2j in the low nibble of byte j and 2j+1 in the high one, so the
nibbles are reordered, never recomputed. llama.cpp's converter permutes the rows of q_proj and k_proj
(its rotary layout); transformers undoes that when it loads a GGUF, and `read_blocks` reorders the same
rows, so a block here is the block of the weight row transformers gives. Other types are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError

BLOCK = 32
# GGUF type -> (format, bytes per block)
TYPES = {"Q4_0": ("q4", 18), "Q4_1": ("q4_min", 20), "Q8_0": ("q8", 34)}


@dataclass
class Blocks:
    """Weight rows [N, K] as blocks of 32 inputs: q4 / q4_min q uint8 [N, blocks, 16] (MatMulNBits' packing),
    q8 q int8 [N, blocks, 32]; scales (and q4_min's mins) float32 [N, blocks]."""

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
        if self.format == "q8":
            return self.q.astype(np.int32)
        codes = np.empty((*self.q.shape[:2], BLOCK), np.int32)
        codes[..., 0::2] = self.q & 15
        codes[..., 1::2] = self.q >> 4
        return codes

    def dense(self) -> np.ndarray:
        """The weights [N, K] in float32, computed as gguf-py dequantizes them (and transformers with it)."""
        c = self.codes().astype(np.float32)
        d = self.scales[..., None]
        if self.format == "q4":
            w = d * (c - np.float32(8))
        elif self.format == "q4_min":
            w = d * c + self.mins[..., None]
        else:
            w = c * d
        return w.reshape(self.n, -1)[:, : self.k]

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


def _parse(type_name: str, raw: np.ndarray, n: int, k: int, name: str) -> Blocks:
    fmt, size = TYPES[type_name]
    blocks = k // BLOCK
    raw = np.ascontiguousarray(raw, np.uint8).reshape(n, blocks, size)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if fmt == "q8":
        return Blocks(fmt, k, raw[..., 2:].copy().view(np.int8), d)
    body = raw[..., 4:] if fmt == "q4_min" else raw[..., 2:]
    codes = np.empty((n, blocks, BLOCK), np.uint8)
    codes[..., :16], codes[..., 16:] = body & 15, body >> 4  # ggml: inputs 0..15 low, 16..31 high
    q = np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4))
    mins = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if fmt == "q4_min" else None
    return Blocks(fmt, k, q, d, mins)


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
        if k % BLOCK:
            raise SpecrtError(f"{self.path}: {name} has rows of {k} inputs, not whole blocks of {BLOCK}")
        blocks = _parse(kind, t.data, n, k, name)
        return blocks if heads is None else blocks.take_rows(rotary_rows(n, heads))


def projection_blocks(path: Path, cfg) -> dict[str, Blocks]:
    """The exported decoder graph's projection weights (export/decoder_graph.py names: the layers' qkv_proj,
    o_proj, gate_up_proj, down_proj and the LM head) as the GGUF at `path` holds them, each scaled as the graph
    folds it (1/√d into q). Only a llama-architecture GGUF is mapped (its q/k row order is the one undone
    here); {} otherwise, and for any projection whose tensors are not all of TYPES (quantized again)."""
    g = GGUFBlocks(path)
    if g.field("general.architecture") != "llama" or cfg.qk_norm:
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
                types = {g.type_of(name) for name, _, _ in tensors}
                if len(types) == 1:
                    out[f"{p}.{proj}.weight"] = Blocks.stack([_scaled(g.read(name, heads), s)
                                                              for name, heads, s in tensors])
    head = "output.weight" if "output.weight" in g.tensors else "token_embd.weight"
    if g.has(head):
        out["model.embed_tokens.weight.T" if head == "token_embd.weight" else "lm_head.weight.T"] = g.read(head)
    return out


def _scaled(b: Blocks, scale: float) -> Blocks:
    if scale == 1.0:
        return b
    s = np.float32(scale)
    return Blocks(b.format, b.k, b.q, b.scales * s, None if b.mins is None else b.mins * s)
