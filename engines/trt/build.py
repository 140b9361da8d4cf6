"""TensorRT engines (GPU path). Every import is gated: without TensorRT this says what to install.

`build_trt` is NEVER RUN in this workplace (no TensorRT, no GPU): it is written against the
documented TensorRT / Polygraphy APIs, and its plan (profiles, version gate, manifest entry) lives in
the pure, tested `specrt.engines.trt.profiles`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.plugins.plugin_names import DEFAULT_MAX_WINDOW
from specrt.plugins.plugin_names import TENSORRT_INSTALL_HINT as INSTALL_HINT


def require_tensorrt():
    """Import tensorrt or raise one clear line saying what to install."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        raise SpecrtError(INSTALL_HINT) from None
    return tensorrt


def tensorrt_available() -> bool:
    try:
        require_tensorrt()
    except SpecrtError:
        return False
    return True


def require_recent_tensorrt():
    """tensorrt, if it is new enough for specrt's engines; SpecrtError otherwise."""
    from specrt.engines.trt.profiles import version_message, version_ok

    trt = require_tensorrt()
    if not version_ok(trt.__version__):
        raise SpecrtError(version_message(trt.__version__))
    return trt


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, then rename: no half-written engine is ever left."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def build_trt(bundle, manifest, precision: str = "fp16", capacity: int | None = None,
              max_window: int | None = None, progress: bool = True) -> dict:
    """Build one serialized TensorRT engine per graph of the bundle; return the manifest entry.

    NEVER RUN in this workplace (no TensorRT). For each graph role: parse the ONNX file with
    `OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE` after registering specrt's plugins (so TreeAttention
    runs as the Triton plugin, not the function body), pin the static dims (batch 1, KV capacity),
    one optimization profile for the window (1 .. max_window), fp16 / bf16 flags (fp32: none), the
    bundle's timing cache loaded and saved across graphs and builds, then write
    `<dir>/<name>.<precision>.engine` atomically.
    """
    from specrt.engines.trt import profiles as plan

    trt = require_recent_tensorrt()
    if precision not in plan.PRECISIONS:
        raise SpecrtError(f"unknown TensorRT precision {precision!r}: use one of {', '.join(plan.PRECISIONS)}")
    plan.check_bundle(manifest)
    try:
        from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, NetworkFromOnnxPath, Profile
        from polygraphy.exception import PolygraphyException
    except ImportError:
        raise SpecrtError(INSTALL_HINT) from None
    from tqdm import tqdm

    from specrt.plugins.tensorrt_plugins import register_plugins

    bundle = Path(bundle)
    max_window = int(max_window or DEFAULT_MAX_WINDOW)
    register_plugins(max_window=max_window)  # before parsing: the parser looks plugins up by name
    cache = bundle / plan.TIMING_CACHE
    capacity = int(capacity or plan.default_capacity(manifest.target.config))
    built = {}
    for role, entry in tqdm(manifest.graphs.items(), desc="tensorrt", unit="graph", disable=not progress):
        src = bundle / entry.file
        shapes = plan.profile_shapes(plan.graph_inputs(src), entry.config, capacity, max_window)
        parse = NetworkFromOnnxPath(str(src), flags=[trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE])
        profile = Profile()
        for name, (lo, opt, hi) in plan.dynamic_inputs(shapes).items():
            profile.add(name, lo, opt, hi)
        config = CreateConfig(profiles=[profile], fp16=precision == "fp16", bf16=precision == "bf16",
                              load_timing_cache=str(cache) if cache.is_file() else None)
        t0 = time.perf_counter()
        try:  # parses, then builds; Polygraphy raises on parser errors and failed builds
            data = EngineBytesFromNetwork(_pinned(parse, shapes), config=config, save_timing_cache=str(cache))()
        except PolygraphyException as e:
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise SpecrtError(f"TensorRT could not build an engine for {src}: {first} (full log above)") from None
        out = plan.engine_file(entry.file, precision)
        write_atomic(bundle / out, bytes(data))
        built[role] = {"file": out, "profile": shapes, "seconds": round(time.perf_counter() - t0, 2)}
    return plan.manifest_entry(trt.__version__, precision, capacity, max_window, built)


def _pinned(parse, shapes):
    """A network loader for Polygraphy: parse, then declare every dim that min = max as static, so the
    KV inputs have the static sequence length TensorRT's in-place KV cache update requires."""
    from specrt.engines.trt.profiles import pinned_shape

    def load():
        builder, network, parser = parse()
        for i in range(network.num_inputs):
            tensor = network.get_input(i)
            lo, _, hi = shapes[tensor.name]
            tensor.shape = pinned_shape(lo, hi)
        return builder, network, parser

    return load
