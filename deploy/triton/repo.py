"""A Triton Inference Server model repository written from a bundle (`specrt export-triton`).

    OUT/
      README.md                    how to launch and call it
      specrt_generate/             Python backend: the speculative loop (specrt's Generator) per request
        config.pbtxt
        1/model.py                 deploy/triton/model.py, verbatim
        1/bundle/...               the bundle (hard links where possible)
      specrt_generate_stream/      with ServeSettings.stream: the same model, decoupled (one response per
        config.pbtxt               text piece; /generate_stream, gRPC streams); reads specrt_generate's bundle
        1/model.py
      specrt_<role>/               onnxruntime backend, one per bundle graph (target, draft, drafters)
        config.pbtxt
        1/model.onnx + its external data file, under the name the graph refers to
      specrt_<role>_trt/           tensorrt_plan backend, where the manifest records TensorRT engines
        config.pbtxt
        1/model.plan

Inputs and outputs in every graph model's config.pbtxt come from the ONNX graph itself; the graphs
carry their own batch dimension, so `max_batch_size: 0`. The repository is written into a temporary
folder beside OUT and renamed into place: OUT is either complete or absent.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx

from specrt.errors import SpecrtError
from specrt.schema.manifest import Manifest

GENERATE_MODEL = "specrt_generate"
STREAM_MODEL = "specrt_generate_stream"
PYTHON_MODEL = Path(__file__).with_name("model.py")
VERSION = "1"

# ONNX TensorProto element type -> Triton ModelConfig DataType
TRITON_DTYPES = {
    onnx.TensorProto.FLOAT: "TYPE_FP32", onnx.TensorProto.FLOAT16: "TYPE_FP16",
    onnx.TensorProto.BFLOAT16: "TYPE_BF16", onnx.TensorProto.DOUBLE: "TYPE_FP64",
    onnx.TensorProto.INT64: "TYPE_INT64", onnx.TensorProto.INT32: "TYPE_INT32",
    onnx.TensorProto.INT8: "TYPE_INT8", onnx.TensorProto.UINT8: "TYPE_UINT8", onnx.TensorProto.BOOL: "TYPE_BOOL",
}

# the Python model's request / response tensors: (name, data type, optional). Counts are INT64: Triton
# converts a JSON number to the declared type by wrapping, so an INT32 count 4294967301 reached the
# model as 5; at INT64 it arrives as sent and model.py refuses it naming that value. max_tokens is no
# tensor but a request parameter: for a declared input tritonserver parses the generate endpoint's JSON
# value itself and answered HTTP 500 to "12", 12.5, true, 1e3 or 2**63 before model.py ran; a key that
# names no input reaches model.py as sent, which refuses a non-integer with HTTP 400 naming max_tokens.
GENERATE_INPUTS = (("text_input", "TYPE_STRING", False), ("temperature", "TYPE_FP32", True),
                   ("top_p", "TYPE_FP32", True), ("top_k", "TYPE_INT64", True), ("seed", "TYPE_INT64", True),
                   ("raw", "TYPE_BOOL", True))
GENERATE_OUTPUTS = (("text_output", "TYPE_STRING"), ("finish_reason", "TYPE_STRING"), ("tokens", "TYPE_INT32"),
                    ("mean_accepted_length", "TYPE_FP32"), ("acceptance_rate", "TYPE_FP32"),
                    ("tokens_per_s", "TYPE_FP32"), ("stats_json", "TYPE_STRING"))


@dataclass(frozen=True)
class ServeSettings:
    """What the Python model's Generator runs with (config.pbtxt `parameters`)."""

    drafter: str = ""  # "": the bundle's tuned drafter (`specrt tune`), else plain
    max_seq_len: int | None = None
    threads: int = 2
    num_draft_tokens: int = 5
    max_tokens: int = 128  # default new tokens when a request sends no max_tokens
    instances: int = 1
    stream: bool = False  # also write STREAM_MODEL, the decoupled (token streaming) twin of GENERATE_MODEL


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # Triton TYPE_*
    dims: tuple[int, ...]  # -1: dynamic


def model_name(role: str, suffix: str = "") -> str:
    """Triton model folder for a graph role: `mtp.0` -> `specrt_mtp_0`."""
    return "specrt_" + re.sub(r"[^A-Za-z0-9_]", "_", role) + suffix


def graph_io(path: Path) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The graph's real inputs (initializers excluded) and outputs, as Triton tensor specs."""
    model = onnx.load(str(path), load_external_data=False)
    initializers = {i.name for i in model.graph.initializer}

    def spec(value) -> TensorSpec:
        t = value.type.tensor_type
        if t.elem_type not in TRITON_DTYPES:
            name = onnx.TensorProto.DataType.Name(t.elem_type)
            raise SpecrtError(f"{path}: tensor {value.name!r} has ONNX type {name}, which has no Triton data "
                              f"type here (supported: {', '.join(sorted(set(TRITON_DTYPES.values())))})")
        dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1 for d in t.shape.dim)
        return TensorSpec(value.name, TRITON_DTYPES[t.elem_type], dims or (1,))

    inputs = [spec(v) for v in model.graph.input if v.name not in initializers]
    return inputs, [spec(v) for v in model.graph.output]


def external_files(path: Path) -> list[str]:
    """The external data files `path` refers to (names relative to its folder)."""
    model = onnx.load(str(path), load_external_data=False)
    tensors = list(model.graph.initializer) + [a.t for n in model.graph.node for a in n.attribute if a.HasField("t")]
    names = {e.value for t in tensors for e in t.external_data if e.key == "location"}
    for name in names:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise SpecrtError(f"{path} refers to external data {name!r} outside its folder: export the bundle again")
    return sorted(names)


def place(src: Path, dst: Path) -> None:
    """Hard link `src` at `dst` (same file system), else copy it."""
    if not src.is_file():
        raise SpecrtError(f"{src} is missing: the bundle is incomplete; export (or build) it again")
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _tensors(kind: str, specs, optional: dict | None = None) -> str:
    rows = []
    for s in specs:
        extra = "\n    optional: true" if optional and optional.get(s.name) else ""
        rows.append(f'  {{\n    name: "{s.name}"\n    data_type: {s.dtype}\n'
                    f'    dims: [ {", ".join(str(d) for d in s.dims)} ]{extra}\n  }}')
    return f"{kind} [\n" + ",\n".join(rows) + "\n]\n"


def graph_config(name: str, platform: str, inputs: list[TensorSpec], outputs: list[TensorSpec],
                 default_model: str) -> str:
    """config.pbtxt of one graph model (onnxruntime_onnx or tensorrt_plan)."""
    return (f'name: "{name}"\nplatform: "{platform}"\nmax_batch_size: 0\n'
            f'default_model_filename: "{default_model}"\n'
            + _tensors("input", inputs) + _tensors("output", outputs)
            + "instance_group [\n  {\n    count: 1\n    kind: "
            + ("KIND_GPU" if platform == "tensorrt_plan" else "KIND_CPU") + "\n  }\n]\n")


def generate_config(settings: ServeSettings, bundle: str, name: str = GENERATE_MODEL,
                    decoupled: bool = False) -> str:
    """config.pbtxt of a Python-backend model (`bundle`: the bundle folder, relative to its model.py)."""
    params = {"bundle": bundle, "drafter": settings.drafter, "threads": str(settings.threads),
              "max_seq_len": "" if settings.max_seq_len is None else str(settings.max_seq_len),
              "num_draft_tokens": str(settings.num_draft_tokens), "max_tokens": str(settings.max_tokens)}
    text = (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
            f"model_transaction_policy {{\n  decoupled: {str(decoupled).lower()}\n}}\n"
            + _tensors("input", [TensorSpec(n, t, (1,)) for n, t, _ in GENERATE_INPUTS],
                       {n: opt for n, _, opt in GENERATE_INPUTS})
            + _tensors("output", [TensorSpec(n, t, (1,)) for n, t in GENERATE_OUTPUTS])
            + f"instance_group [\n  {{\n    count: {settings.instances}\n    kind: KIND_CPU\n  }}\n]\n")
    for key, value in params.items():
        text += f'parameters {{\n  key: "{key}"\n  value: {{\n    string_value: "{value}"\n  }}\n}}\n'
    return text


def _write_onnx_model(bundle: Path, manifest: Manifest, role: str, repo: Path) -> str:
    src = bundle / manifest.graphs[role].file
    if not src.is_file():
        raise SpecrtError(f"{src} is missing: the bundle's {role} graph is gone; export the bundle again")
    name = model_name(role)
    version = repo / name / VERSION
    place(src, version / "model.onnx")
    for data in external_files(src):  # the graph names its data file: keep that name beside model.onnx
        place(src.parent / data, version / data)
    inputs, outputs = graph_io(src)
    (repo / name / "config.pbtxt").write_text(graph_config(name, "onnxruntime_onnx", inputs, outputs, "model.onnx"))
    return name


def _write_trt_model(bundle: Path, manifest: Manifest, role: str, engine: dict, repo: Path) -> str:
    name = model_name(role, "_trt")
    place(bundle / engine["file"], repo / name / VERSION / "model.plan")
    inputs, outputs = graph_io(bundle / manifest.graphs[role].file)  # the engine keeps the graph's tensor names
    (repo / name / "config.pbtxt").write_text(graph_config(name, "tensorrt_plan", inputs, outputs, "model.plan"))
    return name


def _copy_bundle(bundle: Path, dst: Path) -> None:
    for src in sorted(p for p in bundle.rglob("*") if p.is_file()):
        if src.name.endswith(".tmp"):
            continue
        place(src, dst / src.relative_to(bundle))


def write_triton_repo(bundle: Path, out: Path, settings: ServeSettings | None = None,
                      force: bool = False) -> list[str]:
    """Write the Triton model repository for `bundle` at `out`; returns the model names."""
    settings = settings or ServeSettings()
    bundle, out = Path(bundle), Path(out)
    manifest = Manifest.load(bundle)
    if out.exists() and not force:
        raise SpecrtError(f"{out} already exists: choose another OUT or pass --force to replace it")
    if out.resolve() == bundle.resolve() or bundle.resolve() in out.resolve().parents:
        raise SpecrtError(f"OUT {out} is inside the bundle {bundle}: write the repository elsewhere")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        models = [_write_onnx_model(bundle, manifest, role, tmp) for role in manifest.graphs]
        engines = manifest.artifacts.get("tensorrt", {}).get("graphs", {})
        models += [_write_trt_model(bundle, manifest, role, e, tmp) for role, e in engines.items()]
        version = tmp / GENERATE_MODEL / VERSION
        version.mkdir(parents=True)
        shutil.copyfile(PYTHON_MODEL, version / "model.py")
        _copy_bundle(bundle, version / "bundle")
        (tmp / GENERATE_MODEL / "config.pbtxt").write_text(generate_config(settings, "bundle"))
        models.insert(0, GENERATE_MODEL)
        if settings.stream:  # one copy of the bundle: the stream model reads specrt_generate's
            (tmp / STREAM_MODEL / VERSION).mkdir(parents=True)
            shutil.copyfile(PYTHON_MODEL, tmp / STREAM_MODEL / VERSION / "model.py")
            shared = f"../../{GENERATE_MODEL}/{VERSION}/bundle"
            (tmp / STREAM_MODEL / "config.pbtxt").write_text(
                generate_config(settings, shared, STREAM_MODEL, decoupled=True))
            models.insert(1, STREAM_MODEL)
        (tmp / "README.md").write_text(repository_readme(manifest, models, settings))
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return models


def repository_readme(manifest: Manifest, models: list[str], settings: ServeSettings) -> str:
    """README.md of the generated repository: launch, models, request format, curl examples."""
    rows = "\n".join(f"| `{m}` | {_describe(m, manifest)} |" for m in models)
    drafter = settings.drafter or manifest.runtime_defaults.get("drafter", "plain")
    return README.format(rows=rows, drafter=drafter, threads=settings.threads, max_tokens=settings.max_tokens,
                         specrt=manifest.versions.get("specrt", "?"), ort=manifest.versions.get("onnxruntime", "?"))


def _describe(model: str, manifest: Manifest) -> str:
    if model == GENERATE_MODEL:
        return "Python backend: text in, text out; runs specrt's speculative loop (`Generator`) per request"
    if model == STREAM_MODEL:
        return ("Python backend, decoupled: the same generation streamed, one response per text piece "
                "(`/generate_stream`, gRPC streams)")
    for role in manifest.graphs:
        if model == model_name(role):
            return f"onnxruntime backend: the bundle's `{role}` graph (`{manifest.graphs[role].file}`)"
        if model == model_name(role, "_trt"):
            return f"tensorrt_plan backend: the `{role}` TensorRT engine"
    return ""


README = """# specrt Triton model repository

Written by `specrt export-triton` (specrt {specrt}). Launch it with

```
tritonserver --model-repository $(pwd)
```

| model | what it serves |
|---|---|
{rows}

`specrt_generate` is the one to call: it loads the bundle copied under `specrt_generate/1/bundle`
and runs the speculative loop (drafter `{drafter}`, {threads} ONNX Runtime threads, CPU) inside
Triton's Python backend, one request at a time per instance (`instance_group` count in its
`config.pbtxt`; each instance holds its own KV cache). Its `parameters` set the drafter
(`drafter`, empty = the bundle's `specrt tune` choice, else plain), `max_seq_len`, `threads`,
`num_draft_tokens` and the default `max_tokens` ({max_tokens}).

The graph models (`specrt_<role>`) expose the raw decoder graphs (input ids, positions, tree mask,
KV cache in and out) for clients that drive the loop themselves; `specrt_generate` does not call them.

## Requirements

- specrt and its dependencies installed in the Python that Triton's Python backend stub runs
  (the stub's Python version must match: `pip install specrt` inside the Triton container), with
  numpy < 2 there for Triton 2.51's stub (it reads TYPE_STRING tensors wrongly under numpy 2).
  `specrt serve-triton` builds such a Python and runs nvidia-pytriton's `tritonserver` (CPU).
- The onnxruntime backend's ONNX Runtime must read the graphs' opset and the `specrt` local
  functions (the bundle was checked with onnxruntime {ort}); quantized bundles also need the
  `com.microsoft` MatMulNBits kernel.
- `*_trt` models: the engines were built for one GPU and TensorRT version, with specrt's TensorRT
  plugins (`TreeAttention`); Triton's tensorrt backend must find those plugins (same TensorRT version,
  plugins loaded into the server process) or the engines will not deserialize.

## Request

| input | type | |
|---|---|---|
| `text_input` | TYPE_STRING [1] | the prompt (the model's chat template is applied unless `raw`) |
| `max_tokens` | request parameter, integer | optional: new tokens (1 to the context's size − 1; default {max_tokens}) |
| `temperature` | TYPE_FP32 [1] | optional: 0 = greedy (default) |
| `top_p` | TYPE_FP32 [1] | optional: 1 = off |
| `top_k` | TYPE_INT64 [1] | optional: 0 = off |
| `seed` | TYPE_INT64 [1] | optional: same seed, same output |
| `raw` | TYPE_BOOL [1] | optional: skip the chat template |

`max_tokens` is a request parameter, not a tensor: the generate endpoints pass it on as sent, so a value
that is not an integer (`"12"`, `12.5`, `true`, `1e3`) gets HTTP 400 naming it. On `/infer` and gRPC
send it in the request's `parameters` (`"parameters": {{"max_tokens": 64}}`); a `max_tokens` tensor is
refused by tritonserver (`unexpected inference input 'max_tokens'`). The other inputs are tensors:
on the generate endpoints tritonserver itself converts their JSON values, and answers a value of
another JSON type (`"temperature": "0.5"`, `"top_k": 2.5`) with HTTP 500 before the model runs.

Outputs: `text_output`, `finish_reason` ("stop" or "length"), `tokens` (new tokens),
`mean_accepted_length` (tokens per target pass), `acceptance_rate`, `tokens_per_s`, `stats_json`
(every statistic of the generation as JSON).

Generate endpoint (HTTP):

```
curl -s localhost:8000/v2/models/specrt_generate/generate \\
  -d '{{"text_input": "What is speculative decoding?", "max_tokens": 64, "temperature": 0.0}}'
```

Streaming (`specrt_generate_stream`, where the repository has it: `specrt serve-triton` adds it):
each server-sent event carries one text piece, the last one `finish_reason`, `tokens` and the statistics.

```
curl -sN localhost:8000/v2/models/specrt_generate_stream/generate_stream \\
  -d '{{"text_input": "What is speculative decoding?", "max_tokens": 64}}'
```

KServe v2 infer endpoint (HTTP; gRPC takes the same tensors and parameters):

```
curl -s localhost:8000/v2/models/specrt_generate/infer -d '{{"parameters": {{"max_tokens": 64}}, "inputs": [
  {{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["What is speculative decoding?"]}}]}}'
```
"""


INSTANCE_COUNT = re.compile(r"(instance_group\s*\[\s*\{\s*count:\s*)(\d+)")


def set_instance_count(repo: Path, model: str, count: int) -> int:
    """Set `model`'s instance_group count in `repo` (config.pbtxt rewritten atomically); returns the old count."""
    config = Path(repo) / model / "config.pbtxt"
    if not config.is_file():
        raise SpecrtError(f"{config} is missing: {repo} is not a specrt Triton repository (specrt export-triton)")
    text = config.read_text()
    match = INSTANCE_COUNT.search(text)
    if match is None:
        raise SpecrtError(f"{config} has no instance_group count: write the repository again (specrt export-triton)")
    if int(match.group(2)) != count:
        tmp = config.with_name(f".{config.name}.{os.getpid()}.tmp")
        tmp.write_text(text[:match.start(2)] + str(count) + text[match.end(2):])
        os.replace(tmp, config)
    return int(match.group(2))


def _replace(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`; an existing `out` (--force) is moved aside first and removed after."""
    old = None
    if out.exists() or out.is_symlink():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    try:
        tmp.rename(out)
    except OSError:
        if old is not None:
            old.rename(out)
        raise
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
