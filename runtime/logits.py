"""What a request may do to the target's logits before acceptance, and what it may read back from them.

`logit_bias` (OpenAI's: token id → additive bias) changes the target distribution itself: it is added to
every target row before acceptance, in plain and speculative decoding alike, so greedy speculative
output still equals plain greedy output with the same bias, and rejection sampling still follows the
biased target. Drafters draft unbiased; acceptance corrects for that as for any other draft error.

`logprobs` reads the target's log-probabilities of each committed token (and the top-N alternatives)
from the rows that chose it: log-softmax of the biased logits, before temperature / top-k / top-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20
BIAS_LIMIT = 100.0


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token, logprob), most likely first


def biased(logits: np.ndarray, bias: dict[int, float] | None) -> np.ndarray:
    """`logits` [..., V] with `bias` added (a copy; the same array when there is no bias)."""
    if not bias:
        return logits
    ids = np.fromiter(bias, np.int64, len(bias))
    out = logits.astype(np.float32, copy=True)
    out[..., ids] += np.fromiter(bias.values(), np.float32, len(bias))
    return out


def token_logprobs(rows: np.ndarray, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Per committed token: its log-probability under the row that chose it (`rows` [N, V], one per
    token), and the `top` most likely tokens of that row."""
    x = rows.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    out = []
    for row, tok in zip(logp, tokens, strict=True):
        best = np.argsort(-row, kind="stable")[:top] if top else ()
        out.append(TokenLogprob(int(tok), float(row[tok]), tuple((int(t), float(row[t])) for t in best)))
    return out


def check_logit_bias(bias: dict[int, float], vocab: int) -> None:
    """Raise ValueError naming the first token id outside [0, vocab) or bias outside ±BIAS_LIMIT."""
    for tok, value in bias.items():
        if not 0 <= tok < vocab:
            raise ValueError(f"token id {tok} is not in this model's vocabulary (0..{vocab - 1})")
        if not -BIAS_LIMIT <= value <= BIAS_LIMIT:
            raise ValueError(f"the bias {value} of token {tok} is outside [-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}]")
