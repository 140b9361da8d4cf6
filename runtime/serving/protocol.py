"""OpenAI request bodies, validated: wrong types or ranges become a 400 that names the field.

Fields OpenAI clients commonly send but specrt does not implement are accepted at their neutral value
(`n: 1`, penalties `0`, `logprobs` off) and refused otherwise, so a request never silently means
something else. Unknown extra fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP = 4


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # vLLM's extension; 0 = off
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    n: Literal[1] = 1
    presence_penalty: Literal[0, 0.0] = 0.0
    frequency_penalty: Literal[0, 0.0] = 0.0

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops


class CompletionRequest(_Common):
    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: Literal[False] = False
    logprobs: None = None

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


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    logprobs: Literal[False] | None = None
