"""OpenAI response pieces built from what the engine returned: `logprobs` in the chat and the legacy
completions shapes, and `usage`."""

from __future__ import annotations

from collections.abc import Callable

from specrt.runtime.logits import TokenLogprob

Decode = Callable[[list[int]], str]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` where the server has a prefix cache."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def _piece(decode: Decode, token: int) -> str:
    return decode([token])


def chat_logprobs(entries: list[TokenLogprob], decode: Decode) -> dict:
    """`choice.logprobs` of a chat completion: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def one(token: int, logprob: float) -> dict:
        text = _piece(decode, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(entries: list[TokenLogprob], decode: Decode, offset: int = 0) -> dict:
    """`choice.logprobs` of a legacy completion: tokens, token_logprobs, top_logprobs, text_offset
    (`offset`: characters of text before the first entry's token)."""
    tokens = [_piece(decode, e.token) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_piece(decode, t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}
