"""The Triton Python model's inputs, hostile: counts Triton would have wrapped at int32, tensors of the
wrong kind, several values, temperatures too small for float32, a max_tokens request parameter that is
not an integer. model.py runs in-process against the test double of `triton_python_backend_utils`
(tests/cli/test_export_triton.py); no tritonserver."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specrt.deploy.triton.repo import GENERATE_INPUTS, PYTHON_MODEL
from tests.cli.test_export_triton import outputs, python_model, text

PROMPT = "Name three colours."
MAX_SEQ_LEN = 64


@pytest.fixture(scope="module")
def model(tiny_bundle):
    """(model, pb): deploy/triton/model.py initialized over the tiny bundle (draft drafter)."""
    params = {"bundle": str(tiny_bundle), "drafter": "draft", "max_seq_len": str(MAX_SEQ_LEN), "threads": "1"}
    config = json.dumps({"parameters": {k: {"string_value": v} for k, v in params.items()}})
    with python_model(PYTHON_MODEL, "specrt_triton_model_inputs", {"model_config": config}) as served:
        yield served


def answer(model, parameters: dict | None = None, **tensors):
    """The response to one request: `tensors` by name, `parameters` as Triton hands them to the model
    (request.parameters(): one JSON object, the generate endpoint's keys that name no input)."""
    m, pb = model
    request = pb.Request(text_input=text(PROMPT), **tensors)
    request.parameters = lambda: json.dumps(parameters or {})
    [response] = m.execute([request])
    return response


def error(model, parameters: dict | None = None, **tensors) -> str:
    response = answer(model, parameters, **tensors)
    assert response.error is not None, outputs(response)
    return response.error.message()


def test_counts_are_declared_int64_and_max_tokens_is_a_parameter():
    """Triton converts a JSON number to the declared type by wrapping: at INT32 4294967301 reached the
    model as 5, and 3000000000 as -1294967296. max_tokens is no tensor at all: for a declared input
    tritonserver parses the generate endpoint's JSON value itself, and answered HTTP 500 to "12", 12.5,
    true, 1e3 and 2**63 before model.py ran; a key that names no input reaches the model as a request
    parameter (string, integer, bool or double), which model.py checks."""
    declared = {name: kind for name, kind, _ in GENERATE_INPUTS}
    assert declared["top_k"] == declared["seed"] == "TYPE_INT64"
    assert "max_tokens" not in declared


@pytest.mark.parametrize("value", [4294967301, 3000000000, 2**63 - 1, 2**63, MAX_SEQ_LEN, 0, -1])
def test_max_tokens_out_of_range_is_refused_as_sent(model, value):
    message = error(model, {"max_tokens": value})
    assert message.startswith(f"max_tokens {value} is out of range: 1 to {MAX_SEQ_LEN - 1}"), message
    if value < 2**63:  # a repository that declares a max_tokens tensor: the same check
        message = error(model, max_tokens=np.array([value], np.int64))
        assert message.startswith(f"max_tokens {value} is out of range: 1 to {MAX_SEQ_LEN - 1}"), message


# what tritonserver 2.51 hands the model for {"max_tokens": "12" | 12.5 | true | 1e3 | 2**63} (a JSON
# number past int64 arrives as a double), and how the error shows it
NOT_INTEGERS = [("12", '"12"'), (12.5, "12.5"), (True, "true"), (1000.0, "1000.0"),
                (float(2**63), "9.223372036854776e+18"), ("abc", '"abc"'), (-0.0, "-0.0")]


@pytest.mark.parametrize("value, shown", NOT_INTEGERS)
def test_a_max_tokens_parameter_that_is_not_an_integer_is_refused_naming_it(model, value, shown):
    assert error(model, {"max_tokens": value}) == (
        f'max_tokens {shown} is not an integer: send a whole number from 1 to {MAX_SEQ_LEN - 1} '
        f'(a JSON integer, e.g. "max_tokens": {MAX_SEQ_LEN - 1})')


def test_max_tokens_in_range_is_honoured(model):
    assert outputs(answer(model, {"max_tokens": MAX_SEQ_LEN - 1}, raw=np.array([True])))["tokens"] \
        <= MAX_SEQ_LEN - 1
    assert outputs(answer(model, {"max_tokens": 3}))["tokens"] == 3
    assert outputs(answer(model, max_tokens=np.array([3], np.int32)))["tokens"] == 3  # a tensor: any width
    assert outputs(answer(model, {"other": "x"}, max_tokens=np.array([2], np.int64)))["tokens"] == 2


@pytest.mark.parametrize("name, array, declared", [
    ("max_tokens", np.array([4.0], np.float32), "TYPE_INT64"),
    ("top_k", np.array([2.7], np.float64), "TYPE_INT64"),
    ("seed", np.array([True]), "TYPE_INT64"),
    ("temperature", np.array([1], np.int32), "TYPE_FP32"),
    ("top_p", np.array([b"0.9"], np.object_), "TYPE_FP32"),
    ("raw", np.array([1], np.int8), "TYPE_BOOL"),
    ("text_input", np.array([7], np.int64), "TYPE_STRING"),
])
def test_inputs_of_the_wrong_kind_are_refused_not_converted(model, name, array, declared):
    m, pb = model
    tensors = {"text_input": text(PROMPT), "max_tokens": np.array([2], np.int64), name: array}
    [response] = m.execute([pb.Request(**tensors)])
    assert response.error is not None and response.error.message() == \
        f"input {name} has data type {array.dtype}: send it as {declared}", response.error


def test_several_values_are_refused_not_cut_to_the_first(model):
    message = error(model, max_tokens=np.array([5, 7], np.int64))
    assert message == "input max_tokens has 2 values: send one (shape [1])"


@pytest.mark.parametrize("temperature", [1e-300, 1e-38, 1e-42])
def test_tiny_temperatures_sample_the_argmax_not_token_0(model, temperature):
    """float32(1e-38) and float32(1e-42) are subnormals: logits / T overflowed (past 3.4e38), nan, token 0
    every step (1e-300 reaches the model as float32 0: greedy). Either way the answer is greedy's."""
    steps = {"max_tokens": np.array([10], np.int64), "seed": np.array([2], np.int64)}
    greedy = outputs(answer(model, **steps))
    tiny = outputs(answer(model, temperature=np.array([temperature], np.float32), **steps))
    assert tiny["text_output"] == greedy["text_output"] and tiny["tokens"] == greedy["tokens"] == 10
    assert len(set(greedy["text_output"].split())) > 1
