"""The Decoder protocol's output shapes (`output_shape`, `output_width`) on every runner, and the target
state sized from them on any backend (EAGLE-3's aux_hidden_states on TensorRT has no ORT session)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from specrt.engines.decoder import Decoder
from specrt.engines.ort_cpu.runner import OrtDecoder
from specrt.engines.ort_device.runner import OrtDeviceDecoder
from specrt.engines.trt.runner import TrtDecoder
from specrt.runtime.exec_modes import MODES, ShapedDecoder
from specrt.runtime.target import TargetModel
from specrt.schema.config import DecoderConfig

HIDDEN, AUX, CAPACITY = 4, 12, 8  # AUX: three tapped layers of HIDDEN
CFG = DecoderConfig(model_type="llama", vocab_size=16, hidden_size=HIDDEN, intermediate_size=8, num_layers=1,
                    num_heads=1, num_kv_heads=1, head_dim=2, rms_norm_eps=1e-6, rope_inv_freq=(1.0,))


def _graph(tmp_path, aux: bool = True):
    """A graph with the decoder contract's outputs (and its KV passed through); never run, only loaded."""
    vi = helper.make_tensor_value_info
    kv = ["batch", CFG.num_kv_heads, CAPACITY, CFG.head_dim]
    inputs = [vi("input_ids", TensorProto.INT64, ["batch", "tokens"]),
              vi("hidden_in", TensorProto.FLOAT, ["batch", "tokens", HIDDEN]),
              vi("logits_in", TensorProto.FLOAT, ["batch", "rows", "vocab"]),
              vi("past_key.0", TensorProto.FLOAT, kv), vi("past_value.0", TensorProto.FLOAT, kv)]
    nodes = [helper.make_node("Identity", ["logits_in"], ["logits"]),
             helper.make_node("Identity", ["hidden_in"], ["hidden_states"]),
             helper.make_node("Identity", ["past_key.0"], ["present_key.0"]),
             helper.make_node("Identity", ["past_value.0"], ["present_value.0"])]
    outputs = [vi("logits", TensorProto.FLOAT, ["batch", "rows", "vocab"]),
               vi("hidden_states", TensorProto.FLOAT, ["batch", "tokens", HIDDEN]),
               vi("present_key.0", TensorProto.FLOAT, kv), vi("present_value.0", TensorProto.FLOAT, kv)]
    if aux:
        nodes.append(helper.make_node("Concat", ["hidden_in"] * (AUX // HIDDEN), ["aux_hidden_states"], axis=-1))
        outputs.append(vi("aux_hidden_states", TensorProto.FLOAT, ["batch", "tokens", AUX]))
    model = helper.make_model(helper.make_graph(nodes, "decoder", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "decoder.onnx"
    onnx.save(model, str(path))
    return path


class _FakeEngine:
    """What TrtDecoder reads of a deserialized engine for output shapes (TensorRT writes -1 for dynamic)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.shapes = shapes

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]


def _trt_decoder(aux: bool = True) -> TrtDecoder:
    """A TrtDecoder over a fake engine, without TensorRT or a GPU (only what `__init__` collects)."""
    shapes = {"logits": (1, -1, 16), "hidden_states": (1, -1, HIDDEN), "present_key.0": (1, 1, CAPACITY, 2)}
    if aux:
        shapes["aux_hidden_states"] = (1, -1, AUX)
    dec = TrtDecoder.__new__(TrtDecoder)
    dec.engine = _FakeEngine(shapes)
    dec.output_names = [n for n in shapes if not n.startswith("present_")]
    return dec


@pytest.mark.parametrize("runner", [OrtDecoder, OrtDeviceDecoder])
def test_ort_runners_report_the_graphs_output_shapes(tmp_path, runner):
    dec = runner(_graph(tmp_path), CFG, CAPACITY, threads=1)
    assert dec.output_shape("aux_hidden_states") == ("batch", "tokens", AUX)
    assert dec.output_width("aux_hidden_states") == AUX and dec.output_width("hidden_states") == HIDDEN
    assert dec.output_width("logits") is None  # a dynamic last axis
    assert dec.output_shape("present_key.0") is None and dec.output_width("nope") is None  # not outputs here
    assert runner(_graph(tmp_path, aux=False), CFG, CAPACITY, threads=1).output_width("aux_hidden_states") is None


def test_trt_runner_reads_the_engines_output_shape():
    dec = _trt_decoder()
    assert dec.output_shape("aux_hidden_states") == (1, -1, AUX) and dec.output_width("aux_hidden_states") == AUX
    assert dec.output_width("logits") == 16 and dec.output_shape("present_key.0") is None
    assert _trt_decoder(aux=False).output_width("aux_hidden_states") is None


def test_a_dynamic_last_axis_has_no_width():
    dec = _trt_decoder()
    dec.engine.shapes["aux_hidden_states"] = (1, -1, -1)
    assert dec.output_width("aux_hidden_states") is None


def _generator(target) -> TargetModel:
    """Just what `TargetModel.new_state` reads: the target's config, the capacity and the decoder."""
    model = TargetModel.__new__(TargetModel)
    model.manifest = SimpleNamespace(target=SimpleNamespace(config=CFG))
    model.capacity, model.decoder = CAPACITY, target
    return model


class _NoSession(Decoder):
    """A backend's decoder with no ONNX Runtime session: only the protocol says what it outputs."""

    def output_shape(self, name):
        return {"hidden_states": (1, -1, HIDDEN), "aux_hidden_states": (1, -1, AUX)}.get(name)


@pytest.mark.parametrize("target", [_NoSession(), _trt_decoder()], ids=["no-session", "trt"])
@pytest.mark.parametrize("mode", ["direct", "pad2"])
def test_new_state_allocates_the_aux_buffer_on_a_backend_without_a_session(target, mode):
    assert not hasattr(target, "session")
    wrapped = target if mode == "direct" else ShapedDecoder(target, MODES[mode])
    state = _generator(wrapped).new_state()
    assert state.hidden.shape == (CAPACITY + 1, HIDDEN)
    assert state.aux is not None and state.aux.shape == (CAPACITY + 1, AUX) and state.aux.dtype == np.float32


def test_new_state_has_no_aux_buffer_when_the_target_has_no_aux_output(tmp_path):
    for target in (_trt_decoder(aux=False), OrtDecoder(_graph(tmp_path, aux=False), CFG, CAPACITY, threads=1)):
        assert _generator(target).new_state().aux is None
