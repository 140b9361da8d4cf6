"""Weight-only quantization of exported graphs for CPU: ONNX Runtime's `MatMulNBits` (4- or 8-bit).

Every MatMul with a 2-D weight initializer becomes `MatMulNBits` over blocks of 32 inputs; the tied LM
head's `Gemm(x, E, transB=1)` is first rewritten as `MatMul(x, Eᵀ)` so it is quantized too. Where the
source is a GGUF, its own blocks are carried as they are (`carry_blocks`; an int8 embedding table as a
`GatherBlockQuantized` reading the tied head's codes); int4's other weights get scale-and-minimum blocks
fitted to them (export/int4_fit.py); what is left (int8, rows not of whole blocks) goes through ONNX
Runtime's symmetric quantizer. A float table stays fp32. Activations, KV cache, norms and attention stay
fp32.

`accuracy_level=4` lets ORT quantize activations to int8 per block and use its int8 dot-product
kernels. Each row is quantized on its own, but whether a k-row call computes a row bit for bit as a
one-row call does depends on the CPU's kernels (on some AVX2 CPUs the M=1 path differs): that is
measured where the bundle runs, and the runtime picks an execution mode that keeps rows identical
(runtime/exactness.py), so the quantized target is the target.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from specrt.errors import SpecrtError
from specrt.export.gguf_blocks import BLOCK, HALVES, INT8_FORMATS, Blocks


@dataclass(frozen=True)
class Scheme:
    bits: int
    block_size: int
    accuracy_level: int  # 4: int8 activations, int8 dot products; 0: fp32 compute


SCHEMES = {
    "int4": Scheme(bits=4, block_size=32, accuracy_level=4),
    "int8": Scheme(bits=8, block_size=32, accuracy_level=4),
}


def scheme(name: str) -> Scheme:
    if name not in SCHEMES:
        raise SpecrtError(f"unknown quantization {name!r}: choose from {', '.join(SCHEMES)}")
    return SCHEMES[name]


def _quantizer():
    root = logging.getLogger().level  # the module calls logging.basicConfig(level=INFO) on import
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            MatMulNBitsQuantizer,
        )
    except ImportError as e:
        raise SpecrtError(f"weight quantization needs onnxruntime's quantization tools ({e}): "
                          "pip install 'specrt[export]'") from None
    finally:
        logging.getLogger().setLevel(root)
    return MatMulNBitsQuantizer, DefaultWeightOnlyQuantConfig


def untie_head(model: onnx.ModelProto) -> int:
    """Rewrite `Gemm(x, W, transB=1)` on an initializer W as `MatMul(x, Wᵀ)` (a new initializer);
    returns how many were rewritten."""
    inits = {t.name: t for t in model.graph.initializer}
    done = 0
    for node in model.graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if (node.op_type != "Gemm" or len(node.input) != 2 or node.input[1] not in inits
                or attrs.get("transB") != 1 or attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0):
            continue
        w = numpy_helper.to_array(inits[node.input[1]])
        name = f"{node.input[1]}.T"
        model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w.T), name))
        node.op_type, node.input[1] = "MatMul", name
        del node.attribute[:]
        done += 1
    return done


def exact_zero_points(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Float zero points z with fl(-z·d) == m wherever a float32 z achieves it, else within an ulp of m
    (MatMulNBits computes a block's weights as (q - z)·d, so d·q + m needs z = -m/d; the native backend
    reads m back as -z·d; where d·ulp(z) exceeds ulp(m) no z is exact: ~10 % of Q4_1 blocks)."""
    z = (-mins / scales).astype(np.float32)
    for _ in range(4):  # the quotient's rounding: a neighbour of it gives m back exactly
        off = (-z * scales) != mins
        if not off.any():
            break
        up = (-z * scales) < mins
        z = np.where(off, np.nextafter(z, np.where(up, -np.inf, np.inf).astype(np.float32)), z).astype(np.float32)
    return z


def blocks_node(node: onnx.NodeProto, weight: str, blocks, accuracy_level: int) -> tuple[list, list]:
    """`MatMul(x, W)` as a MatMulNBits over `blocks` (export/gguf_blocks.py: the model file's own blocks,
    carried as they are): q4 4-bit symmetric, q4_min 4-bit with float zero points, q8 8-bit symmetric, q8x16
    8-bit symmetric in blocks of 16 (a scale per half block); q8_min and q8x16_min (8-bit with a minimum per
    32 or 16 inputs, which MatMulNBits' 8-bit zero points cannot hold) as MatMulNBits over d·q plus the
    minimums times each block's sum of x (min_term). The nodes, and the initializers they add."""
    fmt, n, k = blocks.format, blocks.n, blocks.k
    eight = fmt in INT8_FORMATS
    tag = "Q8" if eight else "Q4"
    q, scales, arrays = blocks.q, blocks.scales, {}
    if eight:
        q = blocks.q.view(np.uint8) ^ np.uint8(0x80)  # MatMulNBits' 8-bit zero point is 128
    if fmt in HALVES:
        q = q.reshape(n, -1, 16)
    if fmt == "q4_min":
        flat = scales == 0  # d = 0: every weight of the block is m; codes 0, scale -m, zero point 1 say so exactly
        q, scales = np.where(flat[..., None], np.uint8(0), q), np.where(flat, -blocks.mins, scales)
        arrays["zero_points"] = np.where(flat, np.float32(1), exact_zero_points(np.where(flat, 1, scales), blocks.mins))
    arrays = {tag: np.ascontiguousarray(q, np.uint8), "scales": scales.astype(np.float32).reshape(-1),
              **{key: v.astype(np.float32).reshape(-1) for key, v in arrays.items()}}
    inits = [numpy_helper.from_array(v, f"{weight}_{key}") for key, v in arrays.items()]
    inputs = [node.input[0], *(f"{weight}_{key}" for key in arrays)]
    minimums = eight and blocks.mins is not None  # q8_min, q8x16_min (q4_min's are zero points)
    out = f"{node.output[0]}_codes" if minimums else node.output[0]
    new = onnx.helper.make_node("MatMulNBits", inputs, [out], name=f"{node.name}_{tag}", domain="com.microsoft",
                                K=k, N=n, bits=8 if eight else 4, block_size=16 if fmt in HALVES else 32,
                                accuracy_level=accuracy_level)
    if not minimums:
        return [new], inits
    more, more_inits = min_term(node, weight, blocks, out, 16 if fmt in HALVES else 32)
    return [new, *more], inits + more_inits


def min_term(node: onnx.NodeProto, weight: str, blocks, codes: str, size: int) -> tuple[list, list]:
    """node's output = `codes` (x·(d·q)) + Σ_b m_b · Σ_{i in block b} x_i over blocks of `size` inputs: x
    reshaped to [..., K / size, size], summed over each block, times the minimums [K / size, N] (`<weight>_mins`,
    which the native backend reads as the blocks' minimums: engines/native/weights.py)."""
    if blocks.k % 32:
        raise SpecrtError(f"internal: {weight}'s blocks with minimums cover {blocks.k} inputs, not whole blocks of 32")
    x, o, name = node.input[0], node.output[0], node.name
    consts = {"_mins": np.ascontiguousarray(blocks.mins.reshape(blocks.n, -1).T, np.float32),
              "_min_lead": np.array([0], np.int64), "_min_end": np.array([-1], np.int64),
              "_min_block": np.array([blocks.k // size, size], np.int64), "_min_axis": np.array([-1], np.int64)}
    inits = [numpy_helper.from_array(v, weight + key) for key, v in consts.items()]
    make = onnx.helper.make_node
    nodes = [make("Shape", [x], [f"{o}_xshape"], name=f"{name}_min_shape"),
             make("Slice", [f"{o}_xshape", weight + "_min_lead", weight + "_min_end"], [f"{o}_xlead"],
                  name=f"{name}_min_lead"),
             make("Concat", [f"{o}_xlead", weight + "_min_block"], [f"{o}_xblocks_shape"], name=f"{name}_min_concat",
                  axis=0),
             make("Reshape", [x, f"{o}_xblocks_shape"], [f"{o}_xblocks"], name=f"{name}_min_reshape"),
             make("ReduceSum", [f"{o}_xblocks", weight + "_min_axis"], [f"{o}_xsums"], name=f"{name}_min_sum",
                  keepdims=0),
             # an Einsum, not a MatMul: no weight quantizer (nor the native reader) takes it for a float projection
             make("Einsum", [f"{o}_xsums", weight + "_mins"], [f"{o}_min_term"], name=f"{name}_min_einsum",
                  equation="...b,bn->...n"),
             make("Add", [codes, f"{o}_min_term"], [o], name=f"{name}_min_add")]
    return nodes, inits


def table_nodes(node: onnx.NodeProto, weight: str, blocks, codes: str | None = None) -> tuple[list, list]:
    """`Gather(E, ids)` as a GatherBlockQuantized over the int8 `blocks` of E (q8: blocks of 32, q8x16: of 16),
    then a Reshape to [..., H]: codes q + 128 [V, blocks, block] and a float scale per block [V, blocks, 1], whose
    rows ONNX Runtime dequantizes exactly, (q - 128)·d, on lookup. `codes`: an initializer of those very codes
    in that layout already in the graph (a tied head's MatMulNBits weight), read instead of a copy."""
    block = 16 if blocks.format == "q8x16" else 32
    scales = np.ascontiguousarray(blocks.scales, np.float32).reshape(blocks.n, -1, 1)
    inits = [numpy_helper.from_array(scales, f"{weight}_scales"),
             numpy_helper.from_array(np.array([0, 0, -1], np.int64), f"{weight}_rows")]
    if codes is None:
        codes = f"{weight}_Q8"
        q = np.ascontiguousarray(blocks.q.view(np.uint8) ^ np.uint8(0x80)).reshape(blocks.n, -1, block)
        inits.append(numpy_helper.from_array(q, codes))
    gathered = f"{node.output[0]}_blocks"
    return [onnx.helper.make_node("GatherBlockQuantized", [codes, node.input[1], f"{weight}_scales"], [gathered],
                                  name=f"{node.name}_Q8", domain="com.microsoft", bits=8, block_size=block,
                                  gather_axis=0, quantize_axis=2),
            onnx.helper.make_node("Reshape", [gathered, f"{weight}_rows"], list(node.output),
                                  name=f"{node.name}_rows")], inits


TABLE_FORMATS = ("q8", "q8x16")  # the blocks an embedding table is carried in (GatherBlockQuantized is 8-bit here)


def fitted_blocks(model: onnx.ModelProto, taken: dict) -> dict:
    """Int4 blocks fitted to every MatMul weight initializer (2-D, whole blocks of 32 inputs) that `taken`
    does not hold: export/int4_fit.py's scale-and-minimum blocks, by weight name."""
    from specrt.export.int4_fit import fit_q4_min

    return {w: fit_q4_min(rows) for _, w, rows in _whole_block_weights(model, taken)}


def _whole_block_weights(model: onnx.ModelProto, taken: dict):
    """(node, weight name, rows [N, K]) of each MatMul whose weight is a 2-D initializer of whole blocks of 32
    inputs that `taken` does not hold, once per weight."""
    inits = {t.name: t for t in model.graph.initializer}
    seen = set(taken)
    for node in model.graph.node:
        weight = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else None
        if weight in inits and weight not in seen and len(inits[weight].dims) == 2 and inits[weight].dims[0] % BLOCK == 0:
            seen.add(weight)
            yield node, weight, numpy_helper.to_array(inits[weight]).T


class HeadRows:
    """The target's LM-head blocks, indexed once (at first use) for every drafter graph of an export: each row's
    dense values and a fingerprint of them, sorted, so a row is found by its fingerprint and then compared whole."""

    def __init__(self, source):
        self.source, self._index = source, None

    def index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(dense rows, probe, sorted fingerprints, their row order)."""
        if self._index is None:
            dense = self.source.dense()
            probe = np.random.default_rng(0).standard_normal(self.source.k)
            prints = dense.astype(np.float64) @ probe
            order = np.argsort(prints)
            self._index = dense, probe, prints[order], order
        return self._index


def rows_of(model: onnx.ModelProto, head: HeadRows) -> dict:
    """{weight: blocks} for each MatMul weight of `model` whose every row is a row of `head`'s blocks (a drafter's
    head over the target's LM-head rows, all or its draft vocabulary's): those rows of the blocks, so the
    drafter's head computes what the target's head does for them. A weight with one row not there is left out."""
    source = head.source
    inits = {t.name: t for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        init = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if init is None or len(init.dims) != 2 or init.dims[0] != source.k or node.input[1] in out:
            continue
        dense, probe, prints, order = head.index()
        rows = numpy_helper.to_array(init).T
        at = np.clip(np.searchsorted(prints, rows.astype(np.float64) @ probe), 0, len(order) - 1)
        near = np.stack([order[np.clip(at - 1, 0, None)], order[at]])  # the fingerprint's neighbours
        same = [np.isclose(dense[near[j]], rows, rtol=2**-20, atol=0).all(axis=1) for j in range(2)]
        if (same[0] | same[1]).all():
            out[node.input[1]] = source.take_rows(np.where(same[1], near[1], near[0]))
    return out


def q8_blocks(w: np.ndarray) -> Blocks:
    """Symmetric int8 blocks of 32 inputs (Q8_0's rounding, float32 scales) for weight rows `w` [N, K], K a
    multiple of 32: scale = absmax / 127, codes round(w / scale)."""
    n, k = w.shape
    x = np.asarray(w, np.float32).reshape(n, k // BLOCK, BLOCK)
    scales = (np.abs(x).max(-1) / np.float32(127)).astype(np.float32)
    safe = np.where(scales == 0, np.float32(1), scales)
    q = np.clip(np.rint(x / safe[..., None]), -127, 127).astype(np.int8)
    return Blocks("q8", k, q, scales)


def own_heads(model: onnx.ModelProto, taken: dict) -> dict:
    """A learned drafter's own LM-head weights (a MatMul named `lm_head`, untied, whole blocks of 32 inputs) that
    `taken` does not hold, as int8 blocks (q8_blocks): its head ranks the draft candidates, which int4 rounding
    reorders (the shipped EAGLE-3 head's weights with their head as int4: run-time α1 0.406 against 0.420 with the
    same rows as the target's Q8_0 blocks, on 80 held-out prompts), and a head of the target's rows is int8 too."""
    return {w: q8_blocks(rows) for node, w, rows in _whole_block_weights(model, taken) if "lm_head" in node.name}


def _same_blocks(a, b) -> bool:
    return a is b or (a.format == b.format and a.q.shape == b.q.shape and np.array_equal(a.q, b.q)
            and np.array_equal(a.scales, b.scales))


def carry_blocks(model: onnx.ModelProto, blocks: dict, s: Scheme, exact: bool = True) -> list[str]:
    """Replace each MatMul whose weight initializer `blocks` names by a MatMulNBits over those blocks, and each
    Gather from such a table of int8 blocks by a GatherBlockQuantized (sharing the codes of a tied head carried
    from the same blocks), after checking that they are that weight (exact: the graph's fp32 values, to float
    rounding; else blocks fitted to it, of its shape); returns the weights carried (a weight `blocks` names that
    the graph lacks is not)."""
    inits = {t.name: t for t in model.graph.initializer}
    done, nodes, extra = [], [], []
    gathers = []
    for node in model.graph.node:
        if node.op_type == "MatMul" and len(node.input) == 2 and node.input[1] in blocks:
            weight = node.input[1]
            want = numpy_helper.to_array(inits[weight]).T  # [K, N] -> the blocks' [N, K]
        elif (node.op_type == "Gather" and node.input[0] in blocks and node.input[0] in inits
              and blocks[node.input[0]].format in TABLE_FORMATS):
            gathers.append(len(nodes))  # after the MatMuls: a tied head's codes may serve it
            nodes.append(node)
            continue
        else:
            nodes.append(node)
            continue
        _check(weight, blocks[weight], want, exact)
        new, more = blocks_node(node, weight, blocks[weight], s.accuracy_level)
        nodes.extend(new)
        extra.extend(more)
        done.append(weight)
    for at in reversed(gathers):
        node = nodes[at]
        weight = node.input[0]
        b = blocks[weight]
        _check(weight, b, numpy_helper.to_array(inits[weight]), exact)
        head = f"{weight}.T"
        shared = head in done and _same_blocks(blocks[head], b)
        new, more = table_nodes(node, weight, b, f"{head}_Q8" if shared else None)
        nodes[at:at + 1] = new
        extra.extend(more)
        done.append(weight)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(extra)
    return done


def _check(weight: str, b, want: np.ndarray, exact: bool) -> None:
    got = b.dense()
    if got.shape != want.shape or (exact and not _close(got, want, 2**-20)):
        raise SpecrtError(f"internal: the model file's blocks for {weight} are not the weights the graph holds "
                          "(export with --requantize to quantize them again)")


def _close(got: np.ndarray, want: np.ndarray, rtol: float) -> bool:
    """np.allclose(got, want, rtol, atol=0) for float32 weights, in place of its temporaries (2-3x faster:
    seconds over a model's 10^8 weights)."""
    d = np.subtract(got, want, dtype=np.float32)
    np.abs(d, out=d)
    return bool(np.all(d <= np.abs(want).astype(np.float32, copy=False) * np.float32(rtol)))


def quantize_model(model: onnx.ModelProto, s: Scheme, blocks: dict | None = None, fit: bool = True,
                   head: HeadRows | None = None, learned: bool = False) -> tuple[onnx.ModelProto, int, list[str]]:
    """The quantized model, the number of MatMulNBits nodes in it and the weights carried as the model file's
    own blocks (`blocks`, carry_blocks; `head`: the target's LM-head blocks, carried for the weights made of its
    rows, rows_of); a `learned` drafter's own head as int8 blocks (own_heads); int4's others as fitted blocks (export/int4_fit.py) where `fit`, and whatever is left (int8,
    rows not of whole blocks, int4 without `fit`) by ONNX Runtime's symmetric quantizer."""
    quantizer_cls, config_cls = _quantizer()
    untie_head(model)
    if head is not None:
        blocks = {**rows_of(model, head), **(blocks or {})}
    carried = carry_blocks(model, blocks, s) if blocks else []
    if learned:  # a learned drafter's own head, in int8 blocks (own_heads)
        carry_blocks(model, own_heads(model, blocks or {}), s, exact=False)
    if s.bits == 4 and fit:
        carry_blocks(model, fitted_blocks(model, blocks or {}), s, exact=False)
    config = config_cls(block_size=s.block_size, is_symmetric=True, accuracy_level=s.accuracy_level, bits=s.bits)
    log = logging.getLogger("onnxruntime.quantization")  # it logs every node it skips at INFO
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        q = quantizer_cls(model, bits=s.bits, block_size=s.block_size, is_symmetric=True,
                          accuracy_level=s.accuracy_level, algo_config=config)
        q.process()
    finally:
        log.setLevel(level)
    out = q.model.model
    # the quantizer leaves the fp32 copies of rewritten heads behind when nothing else reads them
    used = {i for n in out.graph.node for i in n.input}
    kept = [t for t in out.graph.initializer if t.name in used]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    return out, sum(n.op_type == "MatMulNBits" for n in out.graph.node), carried


def quantize_file(path: Path, s: Scheme, blocks: dict | None = None, fit: bool = True,
                  head: HeadRows | None = None, learned: bool = False) -> tuple[int, list[str]]:
    """Quantize the graph at `path` (external data beside it, `<name>.data`) in place; returns the number of
    quantized MatMuls and the weights carried as the model file's blocks. Written under the final names in a
    scratch folder, then moved over."""
    path = Path(path)
    data = path.name + ".data"
    out, count, carried = quantize_model(onnx.load(str(path), load_external_data=True), s, blocks, fit, head, learned)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        onnx.save_model(out, str(Path(scratch) / path.name), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=data, size_threshold=1024)
        (Path(scratch) / data).replace(path.with_name(data))
        (Path(scratch) / path.name).replace(path)
    return count, carried


def describe(name: str) -> dict:
    return {"scheme": name, **asdict(scheme(name)), "op": "com.microsoft.MatMulNBits"}
