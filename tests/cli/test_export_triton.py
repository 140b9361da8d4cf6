"""`specrt export-triton`: a well-formed Triton model repository whose Python model answers like specrt."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
import sys
import types

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from specrt.cli import cli
from specrt.deploy.triton.repo import GENERATE_INPUTS, GENERATE_OUTPUTS, PYTHON_MODEL
from specrt.errors import SpecrtError
from specrt.schema.manifest import Manifest

ONNX_TO_TRITON = {onnx.TensorProto.INT64: model_config_pb2.TYPE_INT64,
                  onnx.TensorProto.FLOAT: model_config_pb2.TYPE_FP32,
                  onnx.TensorProto.BOOL: model_config_pb2.TYPE_BOOL}
MAX_SEQ_LEN = 64
PROMPT = "Name three colours."


def export(bundle, out, *args):
    return CliRunner().invoke(cli, ["export-triton", str(bundle), str(out), *args])


def load_config(model_dir) -> model_config_pb2.ModelConfig:
    return text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


@pytest.fixture(scope="module")
def repo(tiny_bundle, tmp_path_factory):
    out = tmp_path_factory.mktemp("triton") / "repo"
    result = export(tiny_bundle, out, "--drafter", "draft", "--max-seq-len", str(MAX_SEQ_LEN), "--threads", "1")
    assert result.exit_code == 0, (result.output, result.exception)
    return out


def graph_models(repo):
    return sorted(p for p in repo.iterdir() if p.is_dir() and p.name != "specrt_generate")


def test_layout_one_model_per_graph(repo, tiny_bundle):
    manifest = Manifest.load(tiny_bundle)
    names = {p.name for p in repo.iterdir() if p.is_dir()}
    assert names == {"specrt_generate"} | {"specrt_" + r.replace(".", "_") for r in manifest.graphs}
    assert (repo / "README.md").is_file() and "tritonserver --model-repository" in (repo / "README.md").read_text()
    for model in names:
        assert sorted(p.name for p in (repo / model).iterdir()) == ["1", "config.pbtxt"]
    assert not [p for p in repo.parent.iterdir() if p.name.endswith(".tmp")], "temporary folder left behind"
    # the template is copied verbatim (the packaged, lint-checked file)
    assert (repo / "specrt_generate/1/model.py").read_bytes() == PYTHON_MODEL.read_bytes()


def test_graph_configs_match_the_onnx_graphs(repo):
    for model_dir in graph_models(repo):
        config = load_config(model_dir)
        assert config.name == model_dir.name
        assert config.platform == "onnxruntime_onnx" and config.max_batch_size == 0
        graph = onnx.load(str(model_dir / "1" / config.default_model_filename), load_external_data=False).graph
        inits = {i.name for i in graph.initializer}
        for declared, real in ((config.input, [v for v in graph.input if v.name not in inits]),
                               (config.output, list(graph.output))):
            assert [t.name for t in declared] == [v.name for v in real]
            for t, v in zip(declared, real, strict=True):
                assert t.data_type == ONNX_TO_TRITON[v.type.tensor_type.elem_type], t.name
                assert list(t.dims) == [d.dim_value if d.dim_value > 0 else -1 for d in v.type.tensor_type.shape.dim]


def test_repo_graphs_load_with_their_external_data(repo, tiny_bundle):
    manifest = Manifest.load(tiny_bundle)
    for role, entry in manifest.graphs.items():
        version = repo / ("specrt_" + role.replace(".", "_")) / "1"
        model = onnx.load(str(version / "model.onnx"), load_external_data=False)
        locations = {e.value for i in model.graph.initializer for e in i.external_data if e.key == "location"}
        assert locations, f"{role}: expected external weights"
        for name in locations:
            src = (tiny_bundle / entry.file).parent / name
            assert (version / name).read_bytes() == src.read_bytes()
        session = ort.InferenceSession(str(version / "model.onnx"), providers=["CPUExecutionProvider"])
        assert [i.name for i in session.get_inputs()] == [i.name for i in load_config(version.parent).input]


def test_generate_config(repo):
    config = load_config(repo / "specrt_generate")
    assert config.backend == "python" and not config.platform and config.max_batch_size == 0
    assert config.model_transaction_policy.decoupled is False
    assert [(t.name, model_config_pb2.DataType.Name(t.data_type), t.optional) for t in config.input] == \
        list(GENERATE_INPUTS)
    assert [(t.name, model_config_pb2.DataType.Name(t.data_type)) for t in config.output] == list(GENERATE_OUTPUTS)
    assert config.parameters["bundle"].string_value == "bundle"
    assert (repo / "specrt_generate/1/bundle/manifest.json").is_file()


# ── the Python-backend model, executed in-process against a test double of pb_utils ──────────────
def fake_pb_utils() -> types.ModuleType:
    """The few `triton_python_backend_utils` calls model.py makes, with Triton's semantics."""
    pb = types.ModuleType("triton_python_backend_utils")

    class Tensor:
        def __init__(self, name, array):
            assert isinstance(array, np.ndarray), name
            self._name, self._array = name, array

        def name(self):
            return self._name

        def as_numpy(self):
            return self._array

    class TritonError:
        def __init__(self, msg, code=None):
            self._msg = msg

        def message(self):
            return self._msg

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self.output_tensors, self.error = list(output_tensors), error

    class Request:  # what Triton hands execute(): tensors by name
        def __init__(self, **tensors):
            self.tensors = {k: Tensor(k, v) for k, v in tensors.items()}

    pb.Tensor, pb.TritonError, pb.InferenceResponse, pb.Request = Tensor, TritonError, InferenceResponse, Request
    pb.get_input_tensor_by_name = lambda request, name: request.tensors.get(name)
    return pb


@contextlib.contextmanager
def python_model(path, name: str, args: dict):
    """(model, pb): the Python-backend model file `path` imported as `name` beside the test double of
    pb_utils, initialized with `args` as Triton would, finalized on exit."""
    pb = fake_pb_utils()
    saved = sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = pb
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model = module.TritonPythonModel()
        model.initialize(args)
        yield model, pb
        model.finalize()
    finally:
        if saved is None:
            sys.modules.pop("triton_python_backend_utils", None)
        else:
            sys.modules["triton_python_backend_utils"] = saved


@pytest.fixture(scope="module")
def served(repo):
    """model.py from the repository, initialized as Triton's Python backend would."""
    config = json_format.MessageToJson(load_config(repo / "specrt_generate"), preserving_proto_field_name=True)
    with python_model(repo / "specrt_generate/1/model.py", "specrt_triton_model_py",
                      {"model_config": config, "model_instance_kind": "CPU", "model_instance_device_id": "0",
                       "model_repository": str(repo / "specrt_generate"), "model_version": "1",
                       "model_name": "specrt_generate"}) as served_model:
        yield served_model


def outputs(response) -> dict:
    assert response.error is None, response.error.message()
    out = {}
    for t in response.output_tensors:
        value = t.as_numpy()
        assert value.shape == (1,), t.name()
        out[t.name()] = value[0].decode() if value.dtype == np.object_ else value[0].item()
    return out


def text(s: str) -> np.ndarray:
    return np.array([s.encode()], dtype=np.object_)


def test_python_model_equals_generator(served, tiny_bundle):
    from specrt.runtime.generate import Generator
    from specrt.runtime.sampling import SamplingParams

    model, pb = served
    reference = Generator(tiny_bundle, drafter="draft", max_seq_len=MAX_SEQ_LEN, threads=1)
    greedy = reference.generate(PROMPT, 12, sampling=SamplingParams())
    sampled = reference.generate(PROMPT, 12, sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=7))

    responses = model.execute([
        pb.Request(text_input=text(PROMPT), max_tokens=np.array([12], np.int32)),
        pb.Request(text_input=text(PROMPT), max_tokens=np.array([12], np.int32),
                   temperature=np.array([0.8], np.float32), top_p=np.array([0.9], np.float32),
                   seed=np.array([7], np.int64)),
        pb.Request(max_tokens=np.array([4], np.int32)),
        pb.Request(text_input=text(PROMPT), top_p=np.array([1.5], np.float32)),
    ])
    assert len(responses) == 4
    first = outputs(responses[0])
    assert set(first) == {name for name, _ in GENERATE_OUTPUTS}
    assert first["text_output"] == greedy.text and greedy.token_ids
    assert first["tokens"] == len(greedy.token_ids) and first["finish_reason"] == greedy.finish_reason
    stats = json.loads(first["stats_json"])
    assert stats["drafter"] == "draft" and stats["new_tokens"] == len(greedy.token_ids)
    assert first["mean_accepted_length"] == pytest.approx(greedy.stats.mean_accepted_len, rel=1e-6)
    assert outputs(responses[1])["text_output"] == sampled.text
    assert "text_input" in responses[2].error.message()
    assert "top-p" in responses[3].error.message()


# ── errors, --force, TensorRT engines ─────────────────────────────────────────────────────────────
def test_out_exists_needs_force(tiny_bundle, tmp_path):
    out = tmp_path / "repo"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    result = export(tiny_bundle, out)
    assert isinstance(result.exception, SpecrtError) and "--force" in str(result.exception)
    assert (out / "stale.txt").is_file()
    assert export(tiny_bundle, out, "--force").exit_code == 0
    assert not (out / "stale.txt").exists() and (out / "specrt_generate/config.pbtxt").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]


@pytest.mark.parametrize("make", ["missing", "no_manifest"])
def test_missing_bundle(tmp_path, make):
    bundle = tmp_path / "bundle"
    if make == "no_manifest":
        bundle.mkdir()
    result = export(bundle, tmp_path / "repo")
    assert isinstance(result.exception, SpecrtError)
    assert ("does not exist" if make == "missing" else "manifest.json is missing") in str(result.exception)
    assert not (tmp_path / "repo").exists()


def test_failure_leaves_nothing(tiny_bundle, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, bundle)
    draft = bundle / Manifest.load(bundle).graphs["draft"].file
    (draft.parent / (draft.name + ".data")).unlink()
    result = export(bundle, tmp_path / "out" / "repo")
    assert isinstance(result.exception, SpecrtError) and "is missing" in str(result.exception)
    assert list((tmp_path / "out").iterdir()) == []


def test_tensorrt_engines_become_plan_models(tiny_bundle, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, bundle)
    manifest = Manifest.load(bundle)
    (bundle / "target/decoder.fp16.engine").write_bytes(b"not a real engine")
    manifest.artifacts["tensorrt"] = {"precision": "fp16",
                                      "graphs": {"target": {"file": "target/decoder.fp16.engine", "profile": {}}}}
    manifest.save(bundle)
    assert export(bundle, tmp_path / "repo").exit_code == 0
    model = tmp_path / "repo/specrt_target_trt"
    assert (model / "1/model.plan").read_bytes() == b"not a real engine"
    config = load_config(model)
    assert config.platform == "tensorrt_plan" and config.max_batch_size == 0
    assert [t.name for t in config.input] == [t.name for t in load_config(tmp_path / "repo/specrt_target").input]
