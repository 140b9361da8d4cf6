"""The memory-bandwidth roofline of a verify step: how far each engine is from the bound.

Decoding a small batch on a CPU is bound by memory reads: every target pass streams all the
weights and the KV rows of the context, whatever the number of tokens in the window. So

    bytes per step   = target weights (streamed)                      read once per verify pass
                     + target KV bytes per token × mean context       attention reads the valid prefix
                     + Σ drafter graph (weights + its KV × context) × passes of that graph per step
    bound tokens/s   = tokens per step (τ) × bandwidth ÷ bytes per step
    fraction         = measured decode tokens/s ÷ bound tokens/s

Counting rules (kept explicit, every number lands in the report):

  * weights are the initializers' real byte sizes (external data `length`, raw data, or the packed
    element count: int4/uint4 are half a byte), so quantized graphs (MatMulNBits uint8 blobs +
    scales) count what they store; each initializer counts once however many nodes read it.
  * an initializer read only as the data input of Gather (an embedding table) is not streamed:
    only the looked-up rows are read. It is listed separately (`gathered`) and left out of the bound.
    A table that is also used whole (a tied lm_head) is streamed.
  * KV bytes per token come from the graph's `past_key.*` / `past_value.*` inputs
    ([batch, kv_heads, capacity, head_dim], their element type).
  * drafter passes per step: a drafter graph without a KV cache (Medusa heads, the EAGLE-3 feature
    fuse) runs once per step; the graphs with a KV cache (draft model, EAGLE layer, MTP modules)
    share the drafting depth between them: `depth` passes in all, each reading its weights and KV.
    The depth is the drafter's nominal one (its tree's or MTP's `num_steps`): an upper bound, since
    steps near max_new_tokens or the KV capacity draft shallower (and adaptive drafting may too).
  * the mean context of a step is the prompt length + half the generated tokens (the window's few
    rows are left out); without prompt lengths, half the generated tokens.
  * measured decode tokens/s leaves out prefill: (new tokens − 1) ÷ (seconds − prefill seconds),
    the first token coming from prefill; τ here is the same decode tokens ÷ verify steps.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

_SUB_BYTE_BITS = {TensorProto.INT4: 4, TensorProto.UINT4: 4}
if hasattr(TensorProto, "FLOAT4E2M1"):
    _SUB_BYTE_BITS[TensorProto.FLOAT4E2M1] = 4

BANDWIDTH_METHOD = ("read bandwidth: best pass of np.maximum.reduce over a float32 buffer of several "
                    "times the last-level cache, split over the benchmark's threads; each byte read once "
                    "per pass; GB = 1e9 bytes")


# ── bandwidth ─────────────────────────────────────────────────────────────────────────────────
def last_level_cache_bytes() -> int | None:
    """The largest CPU cache this machine reports (Linux sysfs), or None."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * unit)
        except ValueError:
            continue
    return max(sizes) if sizes else None


def bandwidth_buffer_bytes() -> int:
    """4 × the last-level cache, at least 256 MiB and at most 2 GiB (1 GiB when unknown)."""
    llc = last_level_cache_bytes()
    if llc is None:
        return 1 << 30
    return int(min(max(4 * llc, 256 << 20), 2 << 30))


def measure_bandwidth(seconds: float = 0.5, size_bytes: int | None = None, threads: int = 1) -> float:
    """Memory read bandwidth in GB/s (1e9 bytes/s): the best of repeated `np.maximum.reduce` passes
    over a float32 buffer far beyond the caches (reading is what decode does), at least 3 passes and
    about `seconds` of them. `threads` chunks the buffer so as many cores read at once (numpy
    releases the GIL in reductions); use the thread count the runtime ran with."""
    size = int(size_bytes or bandwidth_buffer_bytes())
    buf = np.ones(max(size // 4, 1024), np.float32)  # written once: its pages are really mapped
    chunks = np.array_split(buf, max(int(threads), 1))
    best, passes, end = math.inf, 0, time.perf_counter() + seconds
    with ThreadPoolExecutor(len(chunks)) as pool:
        while passes < 3 or (time.perf_counter() < end and passes < 100):
            t0 = time.perf_counter()
            list(pool.map(np.maximum.reduce, chunks))
            best = min(best, time.perf_counter() - t0)
            passes += 1
    return buf.nbytes / best / 1e9


# ── bytes in a graph ──────────────────────────────────────────────────────────────────────────
def _element_bits(data_type: int) -> int:
    if data_type in _SUB_BYTE_BITS:
        return _SUB_BYTE_BITS[data_type]
    return np.dtype(helper.tensor_dtype_to_np_dtype(data_type)).itemsize * 8


def tensor_bytes(t: TensorProto) -> int:
    """Bytes an initializer holds: its external data `length`, its raw data, or element count × width."""
    if t.data_location == TensorProto.EXTERNAL:
        info = {e.key: e.value for e in t.external_data}
        if "length" in info:
            return int(info["length"])
    elif t.raw_data:
        return len(t.raw_data)
    if t.data_type == TensorProto.STRING:
        return sum(len(s) for s in t.string_data)
    return (math.prod(t.dims) * _element_bits(t.data_type) + 7) // 8


@dataclass
class GraphWeights:
    """What one pass of a graph reads: streamed initializers, the KV bytes per cached token."""

    path: str
    streamed_bytes: int
    gathered: dict[str, int] = field(default_factory=dict)  # initializers read only by Gather (rows)
    unused: dict[str, int] = field(default_factory=dict)  # initializers no node reads
    kv_bytes_per_token: int = 0
    ops: dict[str, int] = field(default_factory=dict)  # nodes one pass runs by op type, most frequent first

    @property
    def nodes(self) -> int:
        """Operator nodes one pass runs (local functions counted by their bodies)."""
        return sum(self.ops.values())

    @property
    def has_kv(self) -> bool:
        return self.kv_bytes_per_token > 0

    def to_dict(self) -> dict:
        return {"path": self.path, "streamed_bytes": self.streamed_bytes, "gathered": self.gathered,
                "unused": self.unused, "kv_bytes_per_token": self.kv_bytes_per_token, "nodes": self.nodes,
                "ops": self.ops}


def op_counts(model: onnx.ModelProto) -> Counter:
    """Operator nodes of one pass by op type: a call of a local function counts its body (recursively),
    as ONNX Runtime inlines it; a graph already optimized by `specrt build` has no functions left."""
    functions = {(f.domain, f.name): f for f in model.functions}

    def count(nodes) -> Counter:
        c: Counter = Counter()
        for n in nodes:
            body = functions.get((n.domain, n.op_type))
            c.update(count(body.node) if body is not None else {n.op_type: 1})
        return c

    return count(model.graph.node)


def _uses(graph: onnx.GraphProto) -> dict[str, list[tuple[str, int]]]:
    """(op type, input index) of every use of every name, subgraphs included."""
    uses: dict[str, list[tuple[str, int]]] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            uses.setdefault(name, []).append((node.op_type, i))
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                for name, u in _uses(sub).items():
                    uses.setdefault(name, []).extend(u)
    return uses


def _kv_bytes_per_token(graph: onnx.GraphProto) -> int:
    """Σ over the past_key.* / past_value.* inputs [batch, heads, capacity, head_dim]: heads × head_dim
    × element width."""
    total = 0
    for inp in graph.input:
        if not inp.name.startswith(("past_key.", "past_value.")):
            continue
        t = inp.type.tensor_type
        dims = [d.dim_value for d in t.shape.dim]
        if len(dims) == 4 and dims[1] > 0 and dims[3] > 0:
            total += dims[1] * dims[3] * _element_bits(t.elem_type) // 8
    return total


def graph_weights(onnx_path: str | Path) -> GraphWeights:
    """The initializers of a graph file (external data not loaded), sorted by how a pass reads them."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    uses = _uses(model.graph)
    streamed, gathered, unused = 0, {}, {}
    for t in model.graph.initializer:
        n, u = tensor_bytes(t), uses.get(t.name, [])
        if not u:
            unused[t.name] = n
        elif all(use == ("Gather", 0) for use in u):
            gathered[t.name] = n
        else:
            streamed += n
    return GraphWeights(str(onnx_path), streamed, gathered, unused, _kv_bytes_per_token(model.graph),
                        dict(op_counts(model).most_common()))


def graph_weight_bytes(onnx_path: str | Path) -> int:
    """Bytes of weights one pass of the graph streams (Gather-only tables and unused ones left out)."""
    return graph_weights(onnx_path).streamed_bytes


# ── bytes per step and the bound ──────────────────────────────────────────────────────────────
def step_bytes(target: GraphWeights, context: float, drafters: list[tuple[GraphWeights, float]] = ()) -> dict:
    """Bytes read per verify step, by part: the target's weights and KV over `context` tokens, and each
    drafter graph's weights and KV × its passes per step."""
    parts = {"target_weights": target.streamed_bytes, "target_kv": target.kv_bytes_per_token * context,
             "drafter_weights": sum(g.streamed_bytes * p for g, p in drafters),
             "drafter_kv": sum(g.kv_bytes_per_token * context * p for g, p in drafters)}
    parts = {k: int(round(v)) for k, v in parts.items()}
    return {**parts, "total": sum(parts.values())}


def bound_tokens_per_s(tokens_per_step: float, bandwidth_gb_s: float, bytes_per_step: float) -> float:
    """Tokens/s if every step only streamed its bytes at the measured bandwidth."""
    return tokens_per_step * bandwidth_gb_s * 1e9 / bytes_per_step if bytes_per_step > 0 else 0.0


def drafter_passes(graphs: list[GraphWeights], depth: float,
                   share: float = 1.0) -> list[tuple[GraphWeights, float]]:
    """Passes per step of each drafter graph: `share` (the steps that drafted at all) without KV; the
    KV graphs share `depth` passes."""
    with_kv = [g for g in graphs if g.has_kv]
    return [(g, depth / len(with_kv) if g.has_kv else share) for g in graphs]


def decode_totals(rows: list[dict], prompt_tokens: dict[str, int] | None = None) -> dict | None:
    """Decode tokens, seconds and verify steps of an engine's rows, and the steps' mean context.
    None for rows without step statistics (peers)."""
    rows = [r for r in rows if r.get("steps") and r.get("stage_seconds")]
    if not rows:
        return None
    prompt_tokens = prompt_tokens or {}
    tokens = sum(max(r["new_tokens"] - 1, 0) for r in rows)
    seconds = sum(r["seconds"] - r["stage_seconds"].get("prefill", 0.0) for r in rows)
    steps = sum(r["steps"] for r in rows)
    context = sum((prompt_tokens.get(r["id"], 0) + r["new_tokens"] / 2) * r["steps"] for r in rows) / steps
    return {"tokens": tokens, "seconds": seconds, "steps": steps, "mean_context": context}


def config_roofline(totals: dict, parts: dict, bandwidth_gb_s: float) -> dict:
    """Bound, measured decode tokens/s, fraction of the bound and achieved GB/s of one engine."""
    tau = totals["tokens"] / totals["steps"]
    bound = bound_tokens_per_s(tau, bandwidth_gb_s, parts["total"])
    measured = totals["tokens"] / totals["seconds"] if totals["seconds"] > 0 else 0.0
    achieved = parts["total"] * totals["steps"] / totals["seconds"] / 1e9 if totals["seconds"] > 0 else 0.0
    return {"bytes_per_step": parts["total"], "parts": parts, "tokens_per_step": round(tau, 4),
            "mean_context": round(totals["mean_context"], 1), "bound_tokens_per_s": round(bound, 2),
            "measured_tokens_per_s": round(measured, 2),
            "fraction_of_bound": round(measured / bound, 4) if bound else None,
            "measured_gb_s": round(achieved, 2)}


# ── glue: a benchmark result and its generator ───────────────────────────────────────────────
def split_engine(name: str) -> tuple[str, str | None]:
    """`eagle3@wide` -> ("eagle3", "wide"); `eagle3+adaptive` -> ("eagle3", None) (bench's config_name,
    reversed)."""
    from specrt.tools.bench import config_spec

    drafter, _, tree = name.partition("@")
    return config_spec(drafter)[0], tree or None


def drafter_roles(manifest, drafter: str) -> list[str]:
    """The manifest graph roles a runtime drafter runs."""
    from specrt.kinds import runtime_drafters

    spec = runtime_drafters().get(drafter)
    if spec is None or not spec.learned:
        return []
    if spec.bundle_role:
        return [spec.bundle_role] if spec.bundle_role in manifest.graphs else []
    return list(manifest.drafters.get(spec.name, {}).get("graphs", []))


def drafting_depth(gen, drafter: str, tree: str | None) -> int:
    """The drafter's nominal depth per step with the generator's settings (Drafter.nominal_depth)."""
    from specrt.kinds import resolve, runtime_drafters

    settings = gen.settings
    drafter_class = resolve(runtime_drafters()[drafter].runtime[drafter])
    return drafter_class.nominal_depth(gen.manifest, dict(settings.drafter_options),
                                       settings.shape_for(drafter, tree, gen.manifest))


def build_roofline(result: dict, gen, bandwidth_gb_s: float,
                   prompt_tokens: dict[str, int] | None = None) -> dict:
    """The roofline of every specrt configuration of a `run_bench` result (peers: not modelled)."""
    target = graph_weights(gen.target.path)
    cache: dict[str, GraphWeights] = {}

    def weights(role: str) -> GraphWeights:
        if role not in cache:
            cache[role] = graph_weights(gen.manifest.onnx_path(gen.bundle, role))
        return cache[role]

    configs = {}
    for name in result["config"]["configs"]:
        totals = decode_totals([r for r in result["rows"] if r["drafter"] == name], prompt_tokens)
        if totals is None:
            continue
        drafter, tree = split_engine(name)
        graphs = [weights(role) for role in drafter_roles(gen.manifest, drafter)]
        depth = drafting_depth(gen, drafter, tree) if graphs else 0
        rows = [r for r in result["rows"] if r["drafter"] == name and r.get("steps")]
        share = 1.0
        if graphs and any(r.get("mean_draft_depth") for r in rows):  # adaptive: the depth it chose
            steps = sum(r["steps"] for r in rows)
            depth = sum(r["mean_draft_depth"] * r["steps"] for r in rows) / steps
            share = 1 - sum(r.get("plain_steps", 0) for r in rows) / steps
        passes = drafter_passes(graphs, depth, share)
        parts = step_bytes(target, totals["mean_context"], passes)
        configs[name] = {**config_roofline(totals, parts, bandwidth_gb_s),
                         "drafter_passes": {Path(g.path).name: round(p, 3) for g, p in passes}}
    return {"bandwidth_gb_s": round(bandwidth_gb_s, 2), "bandwidth_method": BANDWIDTH_METHOD,
            "target": target.to_dict(), "drafter_graphs": {k: g.to_dict() for k, g in cache.items()},
            "peers": list(result["config"].get("peers", [])), "configs": configs,
            "notes": "bytes per step = target weights + target KV × mean context + Σ drafter graph "
                     "(weights + KV × context) × passes; see specrt.tools.roofline (tools/roofline.py)"}


def prompt_token_counts(gen, prompts, raw: bool = False) -> dict[str, int]:
    """Prompt length in tokens by prompt id, encoded as the benchmark encodes them."""
    return {p.id: len(gen.tokenizer.encode_prompt(p.prompt, raw)) for p in prompts}
