"""Triton Inference Server Python-backend model: specrt's speculative loop behind one endpoint.

`specrt export-triton` copies this file verbatim to `specrt_generate/1/model.py` (and, with streaming,
to `specrt_generate_stream/1/model.py`). It runs inside Triton's Python backend stub
(`triton_python_backend_utils` exists only there), with specrt installed in the stub's Python
(`specrt serve-triton` builds that Python: deploy/triton/server.py). Each model instance loads
the bundle named by config.pbtxt parameter `bundle` (relative to this file) with specrt's `Generator`
and answers one request at a time:

    text_input  TYPE_STRING [1]            the prompt (chat template applied unless raw=true)
    max_tokens  TYPE_INT64  [1] optional   new tokens, 1 to capacity - 1 (default: parameter max_tokens)
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
another kind (a float max_tokens, an int temperature) is refused naming the input, never converted.
Counts are INT64 because Triton wraps a JSON number into the declared type; values out of range are
refused as sent (max_tokens 4294967301, not the 5 an INT32 made of it).
"""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

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
        """generate()'s keyword arguments from the request's tensors; SpecrtError / ValueError when bad."""
        from specrt.errors import SpecrtError
        from specrt.runtime.sampling import SamplingParams

        prompt = _scalar(request, "text_input", None)
        if prompt is None:
            raise SpecrtError("the request has no text_input: send the prompt as a TYPE_STRING [1] tensor")
        sampling = SamplingParams(temperature=_scalar(request, "temperature", 0.0),
                                  top_k=_scalar(request, "top_k", 0),
                                  top_p=_scalar(request, "top_p", 1.0),
                                  seed=_scalar(request, "seed", None))
        max_tokens = _scalar(request, "max_tokens", None)
        if max_tokens is None:
            max_tokens = self.max_tokens
        elif not 1 <= max_tokens < self.generator.capacity:  # as sent: INT64, never wrapped
            raise SpecrtError(f"max_tokens {max_tokens} is out of range: 1 to {self.generator.capacity - 1} (this "
                              f"model's context is {self.generator.capacity} tokens, the prompt included)")
        return {"prompt": prompt, "max_new_tokens": max_tokens, "raw": bool(_scalar(request, "raw", False)),
                "sampling": sampling}

    def _respond(self, request):
        from specrt.errors import SpecrtError

        try:
            result = self.generator.generate(**self._arguments(request))
        except (SpecrtError, ValueError, TypeError) as e:  # a bad request fails alone, not the batch
            return pb_utils.InferenceResponse(output_tensors=[], error=_invalid(str(e)))
        return pb_utils.InferenceResponse(output_tensors=self._outputs(result, result.text))

    def _stream(self, request) -> None:
        from specrt.errors import SpecrtError

        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            stream = self.generator.iter_text(**self._arguments(request))
            for piece in stream:
                sender.send(pb_utils.InferenceResponse(output_tensors=[_tensor("text_output", piece, np.object_)]))
        except (SpecrtError, ValueError, TypeError) as e:
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=_invalid(str(e))), flags=final)
            return
        sender.send(pb_utils.InferenceResponse(output_tensors=self._outputs(stream.result, "")), flags=final)

    def _outputs(self, result, text: str) -> list:
        stats = result.stats
        info = {"drafter": self.generator.drafter_name, "instance": self.instance, **stats.to_dict()}
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
