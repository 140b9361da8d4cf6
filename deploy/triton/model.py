"""Triton Inference Server Python-backend model: specrt's speculative loop behind one endpoint.

`specrt export-triton` copies this file verbatim to `specrt_generate/1/model.py` (and, with streaming,
to `specrt_generate_stream/1/model.py`). It runs inside Triton's Python backend stub
(`triton_python_backend_utils` exists only there), with specrt installed in the stub's Python
(`specrt serve-triton` builds that Python: deploy/triton/server.py). Each model instance loads
the bundle named by config.pbtxt parameter `bundle` (relative to this file) with specrt's `Generator`
and answers one request at a time:

    text_input  TYPE_STRING [1]            the prompt (chat template applied unless raw=true)
    max_tokens  request parameter, int     new tokens, 1 to capacity - 1 (default: parameter max_tokens)
    temperature TYPE_FP32   [1] optional   0 = greedy (default)
    top_p       TYPE_FP32   [1] optional   1 = off
    top_k       TYPE_INT64  [1] optional   0 = off
    seed        TYPE_INT64  [1] optional   same seed, same output
    raw         TYPE_BOOL   [1] optional   skip the chat template
 →  text_output, finish_reason (TYPE_STRING [1]); tokens (TYPE_INT32 [1]);
    mean_accepted_length, acceptance_rate, tokens_per_s (TYPE_FP32 [1]); stats_json (TYPE_STRING [1])

Decoupled (config.pbtxt `model_transaction_policy { decoupled: true }`): one response per committed
text piece (`text_output` only), then a final response (flag COMPLETE_FINAL) with `text_output` ""
and every other output; the pieces concatenate to the unary `text_output`.

Each input must have its declared type's kind (an integer count, a float, a bool, text): a tensor of
another kind (a float top_k, an int temperature) is refused naming the input, never converted.
Counts are INT64 because Triton wraps a JSON number into the declared type; values out of range are
refused as sent (max_tokens 4294967301, not the 5 an INT32 made of it).

max_tokens is a request parameter, not a tensor: for a declared input tritonserver converts the
generate endpoint's JSON value itself and answers HTTP 500 to one of another JSON type ("12", 12.5,
true, 1e3, 2**63 for an INT64) before this code runs. A generate key that names no input arrives in
request.parameters() as it was sent (a string, an integer, a bool, or a double: 1e3 as 1000.0, an
integer past int64 as a double), so this code refuses every non-integer with INVALID_ARG (HTTP 400)
naming max_tokens. KServe /infer and gRPC requests send it the same way: `"parameters": {"max_tokens":
64}`. A max_tokens tensor is still read where a repository declares one.
"""

import json
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from specrt.errors import SpecrtError

DEFAULTS = {"bundle": "bundle", "drafter": "", "max_seq_len": "", "threads": "2", "num_draft_tokens": "5",
            "max_tokens": "128"}


def _parameters(model_config: dict) -> dict:
    """config.pbtxt `parameters` (string values) over the defaults."""
    given = {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}
    return {**DEFAULTS, **{k: v for k, v in given.items() if v != ""}}


# numpy dtype kinds each input may arrive as (config.pbtxt declares one; another is a misconfigured
# repository or client, refused rather than converted: int(2.7) and float(True) would pass silently)
INPUT_KINDS = {"text_input": ("OS", "TYPE_STRING"), "max_tokens": ("iu", "TYPE_INT64"),
               "temperature": ("f", "TYPE_FP32"), "top_p": ("f", "TYPE_FP32"), "top_k": ("iu", "TYPE_INT64"),
               "seed": ("iu", "TYPE_INT64"), "raw": ("b", "TYPE_BOOL")}


def _scalar(request, name: str, default):
    """The element of optional input `name` (shape [1], of its declared kind), or `default` when the
    request does not carry it; ValueError naming the input otherwise."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    array = tensor.as_numpy()
    kinds, declared = INPUT_KINDS[name]
    if array.dtype.kind not in kinds:
        raise ValueError(f"input {name} has data type {array.dtype}: send it as {declared}")
    values = array.reshape(-1)
    if values.size == 0:
        return default
    if values.size > 1:
        raise ValueError(f"input {name} has {values.size} values: send one (shape [1])")
    value = values[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value.item()


def _request_parameter(request, name: str):
    """Request parameter `name` as sent (str, int, bool or float), or None when the request has none."""
    parameters = getattr(request, "parameters", None)
    given = json.loads(parameters() or "{}") if parameters is not None else {}
    return given.get(name) if isinstance(given, dict) else None


def _count(name: str, value, capacity: int) -> int:
    """`value` as a count of new tokens, 1 to capacity - 1; SpecrtError naming `name` otherwise."""
    example = min(64, capacity - 1)
    if isinstance(value, bool) or not isinstance(value, int):  # "12", 12.5, true, 1e3 (a float): refused
        raise SpecrtError(f"{name} {json.dumps(value)} is not an integer: send a whole number from 1 to "
                          f'{capacity - 1} (a JSON integer, e.g. "{name}": {example})')
    if not 1 <= value < capacity:  # as sent: never wrapped
        raise SpecrtError(f"{name} {value} is out of range: 1 to {capacity - 1} (this model's context is "
                          f"{capacity} tokens, the prompt included)")
    return value


def _tensor(name: str, value, dtype) -> "pb_utils.Tensor":
    if dtype is np.object_:
        return pb_utils.Tensor(name, np.array([str(value).encode("utf-8")], dtype=np.object_))
    return pb_utils.Tensor(name, np.array([value], dtype=dtype))


def _invalid(message: str) -> "pb_utils.TritonError":
    """A client error: INVALID_ARG (HTTP 400) where the backend has error codes (Triton >= 23.06), else
    the backend's default code."""
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
    return pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)


class TritonPythonModel:
    """One `Generator` per model instance (instances do not share KV buffers)."""

    def initialize(self, args):
        from specrt.runtime.generate import Generator
        from specrt.schema.manifest import Manifest

        config = json.loads(args["model_config"])
        params = _parameters(config)
        self.decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
        self.instance = args.get("model_instance_name", "")
        bundle = Path(params["bundle"])
        if not bundle.is_absolute():
            bundle = Path(__file__).resolve().parent / bundle
        tuned = Manifest.load(bundle).runtime_defaults
        drafter = params["drafter"] or tuned.get("drafter", "plain")
        self.max_tokens = int(params["max_tokens"])
        self.generator = Generator(
            bundle, drafter=drafter, max_seq_len=int(params["max_seq_len"]) if params["max_seq_len"] else None,
            threads=int(params["threads"]), num_draft_tokens=int(params["num_draft_tokens"]))

    def execute(self, requests):
        if self.decoupled:  # every response goes through the request's sender; execute returns None
            for request in requests:
                self._stream(request)
            return None
        return [self._respond(request) for request in requests]

    def _arguments(self, request) -> dict:
        """generate()'s keyword arguments from the request's tensors and parameters; SpecrtError /
        ValueError when bad."""
        from specrt.runtime.sampling import SamplingParams

        prompt = _scalar(request, "text_input", None)
        if prompt is None:
            raise SpecrtError("the request has no text_input: send the prompt as a TYPE_STRING [1] tensor")
        sampling = SamplingParams(temperature=_scalar(request, "temperature", 0.0),
                                  top_k=_scalar(request, "top_k", 0),
                                  top_p=_scalar(request, "top_p", 1.0),
                                  seed=_scalar(request, "seed", None))
        max_tokens = _scalar(request, "max_tokens", None)  # a tensor, where a repository declares one
        if max_tokens is None:
            max_tokens = _request_parameter(request, "max_tokens")
        max_tokens = self.max_tokens if max_tokens is None else _count("max_tokens", max_tokens,
                                                                        self.generator.capacity)
        return {"prompt": prompt, "max_new_tokens": max_tokens, "raw": bool(_scalar(request, "raw", False)),
                "sampling": sampling}

    def _respond(self, request):
        started = time.monotonic()
        try:
            result = self.generator.generate(**self._arguments(request))
        except (SpecrtError, ValueError, TypeError) as e:  # a bad request fails alone, not the batch
            return pb_utils.InferenceResponse(output_tensors=[], error=_invalid(str(e)))
        return pb_utils.InferenceResponse(output_tensors=self._outputs(result, result.text, started))

    def _stream(self, request) -> None:
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        started = time.monotonic()
        try:
            stream = self.generator.iter_text(**self._arguments(request))
            for piece in stream:
                sender.send(pb_utils.InferenceResponse(output_tensors=[_tensor("text_output", piece, np.object_)]))
        except (SpecrtError, ValueError, TypeError) as e:
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=_invalid(str(e))), flags=final)
            return
        sender.send(pb_utils.InferenceResponse(output_tensors=self._outputs(stream.result, "", started)),
                    flags=final)

    def _outputs(self, result, text: str, started: float) -> list:
        stats = result.stats
        # `executed`: when this instance began and ended the request, in seconds of the machine's
        # CLOCK_MONOTONIC, one clock for every process of the server: requests whose spans intersect
        # ran at the same time (on different instances)
        info = {"drafter": self.generator.drafter_name, "instance": self.instance,
                "executed": [started, time.monotonic()], **stats.to_dict()}
        return [
            _tensor("text_output", text, np.object_),
            _tensor("finish_reason", result.finish_reason, np.object_),
            _tensor("tokens", len(result.token_ids), np.int32),
            _tensor("mean_accepted_length", stats.mean_accepted_len, np.float32),
            _tensor("acceptance_rate", stats.acceptance_rate, np.float32),
            _tensor("tokens_per_s", stats.tokens_per_s, np.float32),
            _tensor("stats_json", json.dumps(info), np.object_),
        ]

    def finalize(self):
        self.generator = None
