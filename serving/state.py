"""What every request handler reads: the scheduler, the model's name and limits, and the checks a request
passes before it is submitted. One `ServerState` per app (`app.state.server`); the handlers in
serving/routes.py and serving/completion.py are plain functions over it, so each can be called alone."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from specrt.errors import SpecrtError
from specrt.runtime.logits import check_logit_bias
from specrt.runtime.sampling import SamplingParams
from specrt.serving.errors import ApiError
from specrt.serving.handle import Handle
from specrt.serving.scheduler import Scheduler, SchedulerFull


@dataclass
class ServerState:
    scheduler: Scheduler
    model_name: str
    default_max_tokens: int = 256
    exactness: dict = field(init=False)  # what /v1/models says of losslessness

    def __post_init__(self):
        gen = self.scheduler.gen
        self.gen, self.tokenizer, self.capacity = gen, gen.tokenizer, gen.capacity
        self.vocab = gen.manifest.target.config.vocab_size
        # a text longer than the context × the longest token cannot fit: refused before it is tokenized
        self.max_chars = self.capacity * self.tokenizer.max_token_bytes
        self.exactness = {
            "lossless": gen.lossless, "exec_mode": gen.exactness.mode.name,
            "batch_invariant": gen.exactness.lossless, "reason": gen.exactness.reason,
            "drafter": self.scheduler.drafter_name, "requested_drafter": gen.requested_drafter, "slots": gen.slots,
            # what greedy responses equal (sampled ones follow its distribution); null where not lossless
            "exact_to": gen.reference.to_dict() if gen.lossless else None}

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist: this server serves {self.model_name!r}",
                           "model", "model_not_found")

    def check_length(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise ApiError(400, f"the {param} has {chars} characters: more than this server's context of "
                           f"{self.capacity} tokens can hold (at most {self.max_chars} characters): shorten it",
                           param, "context_length_exceeded")

    def max_tokens(self, body, prompt_tokens: int) -> int:
        """The request's completion limit (the server's default where it names none), checked to fit."""
        if prompt_tokens >= self.capacity:
            raise ApiError(400, f"the prompt has {prompt_tokens} tokens but this server's context is "
                           f"{self.capacity} tokens: shorten it", "prompt", "context_length_exceeded")
        room = self.capacity - prompt_tokens
        limit = body.completion_limit
        max_tokens = limit if limit is not None else min(self.default_max_tokens, room)
        if max_tokens > room:
            name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
            raise ApiError(400, f"{name} {max_tokens} does not fit: context {self.capacity} tokens − prompt "
                           f"{prompt_tokens} = {room} at most", name, "context_length_exceeded")
        return max_tokens

    def submit(self, body, ids: list[int]) -> Handle:
        """Queue the request (called on the event loop, which its tokens are delivered to)."""
        max_tokens = self.max_tokens(body, len(ids))
        try:
            check_logit_bias(body.logit_bias or {}, self.vocab)
        except ValueError as e:
            raise ApiError(400, f"logit_bias: {e}", "logit_bias") from None
        sampling = SamplingParams(body.temperature, body.top_k, body.top_p, body.seed)
        options = {"logit_bias": body.logit_bias, "logprobs": body.wanted_logprobs}
        try:
            return self.scheduler.submit(ids, max_tokens, sampling, asyncio.get_running_loop(), options)
        except SchedulerFull as e:
            raise ApiError(503, str(e), code="server_busy", kind="server_error") from None
        except SpecrtError as e:
            raise ApiError(400, str(e)) from None
