"""Token ids to released text for one response: stop sequences, and never half a character.

Text is released only when it is final: not ending in a partial UTF-8 character, and not ending in
something that could still grow into a stop sequence (that tail is held back until it cannot).
"""

from __future__ import annotations

from collections.abc import Callable


class TextAssembler:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str] | None):
        self.decode, self.stops = decode, list(stops or [])
        self.ids: list[int] = []
        self.text = ""  # released so far (the final text once stopped)
        self.last_piece = ""  # released together with the stop
        self.stopped = False

    @property
    def tokens(self) -> int:
        return len(self.ids)

    def feed(self, tokens: list[int]) -> str | None:
        """Newly releasable text (maybe ""), or None when a stop sequence ended the response (the text
        before it is in `last_piece`)."""
        if self.stopped:
            return None
        self.ids.extend(tokens)
        full = self.decode(self.ids)
        if not full.startswith(self.text):  # the decoder revised released text (should not happen)
            return ""
        hits = [i for i in (full.find(s, len(self.text)) for s in self.stops) if i >= 0]
        if hits:
            cut = min(hits)
            self.last_piece, self.text, self.stopped = full[len(self.text) : cut], full[:cut], True
            return None
        if full.endswith("\ufffd"):
            return ""
        safe = full[: len(full) - self._held(full)]
        piece, self.text = safe[len(self.text) :], safe
        return piece

    def flush(self) -> str:
        """At the end: release what was held back."""
        if self.stopped:
            return ""
        full = self.decode(self.ids)
        piece = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += piece
        return piece

    def finish_reason(self, result) -> str:
        if self.stopped or result is None:
            return "stop"
        return result.finish_reason

    def _held(self, full: str) -> int:
        """Length of the longest tail of `full` that is a proper prefix of a stop sequence."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(full)), best, -1):
                if full.endswith(s[:k]):
                    best = k
                    break
        return best
