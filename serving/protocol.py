"""OpenAI request bodies, validated: wrong types or ranges become a 400 that names the field.

Every field of OpenAI's (and vLLM's) request bodies is either honoured or refused: fields specrt does not
implement are accepted only at their neutral value (`n: 1`, penalties `0`, no `tools`, `response_format`
text) and refused with a 400 naming them otherwise, so a request never silently means something else.
Fields that do not change the output (`user`, `metadata`, `store`, `service_tier`, …) and names neither
API defines are ignored, as OpenAI-compatible servers do. Every string must be valid Unicode text (a
lone UTF-16 surrogate such as "\\ud800" is refused).

Every field is strict, as OpenAI's API is: a value of another JSON type is refused, never converted
(`max_tokens: "4"`, `max_tokens: true`, `max_tokens: 4.0`, `stream: "yes"`, `temperature: "0.5"` are all
400s naming the field and the type it needs). The one conversion is JSON's own: an integer is a valid
number (`temperature: 1`), and `logit_bias` keys, JSON object keys, are token ids written in decimal.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)

from specrt.runtime.logits import MAX_TOP_LOGPROBS

MAX_STOP = 4


def _unicode(v: str) -> str:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode text: {v[e.start : e.end]!r} at character {e.start} is an "
                         "unpaired UTF-16 surrogate") from None
    return v


Text = Annotated[str, AfterValidator(_unicode)]


def _token_id(v):
    """A `logit_bias` key: JSON object keys are strings, so a token id arrives as decimal digits."""
    if isinstance(v, str) and re.fullmatch(r"-?[0-9]+", v):
        return int(v)
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise ValueError(f"the key {v!r} is not a token id (an integer written in decimal, like \"50256\")")


TokenId = Annotated[int, BeforeValidator(_token_id)]


def _neutral(*allowed: Any):
    """A validator refusing every value of a field but its neutral ones (given, or None)."""

    def check(v):
        if v is not None and v not in allowed:
            if not allowed:
                raise ValueError("is not supported by this server: send the request without it")
            raise ValueError(f"{v!r} is not supported by this server (only {' or '.join(map(repr, allowed))})")
        return v

    return AfterValidator(check)


def _needs(flag: str):
    """A field validator: the field may be given only when the (earlier) field `flag` is true."""

    def check(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get(flag):
            raise ValueError(f"is only allowed with {flag}: true")
        return v

    return classmethod(check)


def _empty_list(v):
    if v:
        raise ValueError("is not supported by this server: send the request without it")
    return v


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0)  # vLLM's extension; 0 = off
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[TokenId, float] | None = None  # ids and values checked against the model: api.py
    # implemented at their neutral value only
    n: Annotated[int, _neutral(1)] = 1  # a strict int: a Literal would take true and 1.0
    presence_penalty: Annotated[float | None, _neutral(0, 0.0)] = None
    frequency_penalty: Annotated[float | None, _neutral(0, 0.0)] = None
    repetition_penalty: Annotated[float | None, _neutral(1, 1.0)] = None  # vLLM's
    min_p: Annotated[float | None, _neutral(0, 0.0)] = None  # vLLM's
    min_tokens: Annotated[int | None, _neutral(0)] = None  # vLLM's
    ignore_eos: Annotated[bool | None, _neutral(False)] = None  # vLLM's

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    _with_stream = field_validator("stream_options")(_needs("stream"))

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common):
    prompt: Text | list[Text]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # top-N per token
    echo: Annotated[bool, _neutral(False)] = False
    best_of: Annotated[int | None, _neutral(1)] = None
    suffix: Annotated[str | None, _neutral("")] = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("give one prompt (a string, or a list holding one string)")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v

    @property
    def wanted_logprobs(self) -> int | None:
        """Top-N alternatives per token, or None when no logprobs were asked for."""
        return self.logprobs

    @property
    def completion_limit(self) -> int | None:
        return self.max_tokens


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: Text


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: Text | None = None
    tool_calls: Annotated[list | None, AfterValidator(_empty_list)] = None

    def render(self) -> dict:
        """The message as the chat template takes it (text parts joined; OpenAI's `developer` is the
        template's `system`)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # implemented at their neutral value only
    tools: Annotated[list | None, AfterValidator(_empty_list)] = None
    functions: Annotated[list | None, AfterValidator(_empty_list)] = None
    tool_choice: Annotated[Any, _neutral("none")] = None
    function_call: Annotated[Any, _neutral("none")] = None
    response_format: Annotated[Any, _neutral({"type": "text"})] = None
    modalities: Annotated[Any, _neutral(["text"])] = None
    audio: Annotated[Any, _neutral()] = None
    prediction: Annotated[Any, _neutral()] = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_limit(cls, v, info: ValidationInfo):
        other = info.data.get("max_tokens")
        if None not in (v, other) and v != other:
            raise ValueError(f"{v} disagrees with max_tokens {other}: send one of them")
        return v

    _with_logprobs = field_validator("top_logprobs")(_needs("logprobs"))

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ── refusals ─────────────────────────────────────────────────────────────────────────────────
JSON_KINDS = ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"), (list, "an array"),
              (dict, "an object"))  # bool before int: true is an int to Python


def _json_kind(value) -> str:
    """What a JSON value is, in words: `a string ("4")`, `an array`, `null`."""
    if value is None:
        return "null"
    kind = next((name for t, name in JSON_KINDS if isinstance(value, t)), type(value).__name__)
    if not isinstance(value, (bool, int, float, str)):
        return kind
    shown = json.dumps(value)
    return f"{kind} ({shown[:40]}{'…' if len(shown) > 40 else ''})"


def _wrong_type(e: dict) -> bool:
    return str(e.get("type", "")).endswith("_type") and "input" in e


def _one(errors: list[dict]) -> str:
    """One field's errors as one phrase. A union (`stop`: a string or a list of strings) reports each
    alternative: one whose type matched says most (a string that is not valid text); else the deepest
    ("stop: [1]" fails inside the list); alternatives that all failed on the value itself are joined
    ("a valid string or a valid list")."""
    right_type = [e for e in errors if not _wrong_type(e)]
    if right_type:
        return right_type[0].get("msg", "invalid")
    depth = max(len(e.get("loc", ())) for e in errors)
    deepest = [e for e in errors if len(e.get("loc", ())) == depth]
    wanted = [e["msg"].removeprefix("Input should be ") for e in deepest]
    return f"Input should be {' or '.join(dict.fromkeys(wanted))}, not {_json_kind(deepest[0]['input'])}"


def describe_errors(errors: list[dict], max_fields: int = 5) -> tuple[str, str | None]:
    """One readable line from pydantic's errors of a request body, and the first offending field:
    `max_tokens: Input should be a valid integer, not a string ("4")`."""
    by_field: dict[str, list[dict]] = {}
    for e in errors:
        if e.get("type") == "json_invalid":
            return f"the request body is not valid JSON ({e.get('ctx', {}).get('error', 'parse error')})", None
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        by_field.setdefault(loc[0] if loc else "body", []).append(e)
    parts = [f"{field}: {_one(errs)}" for field, errs in list(by_field.items())[:max_fields]]
    return "; ".join(parts) or "invalid request body", next(iter(by_field), None)
