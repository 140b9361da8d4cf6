"""Tokenizer and chat template without transformers: `tokenizers` + a sandboxed Jinja2 render.

The template is rendered with the same Jinja settings `transformers.apply_chat_template` uses
(trim_blocks, lstrip_blocks, `raise_exception`, `tojson`), and the rendered text is encoded without
adding special tokens (the template writes them), as transformers does.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

from specrt.errors import SpecrtError


def _raise(message: str):
    raise SpecrtError(f"chat template: {message}")


class Tokenizer:
    def __init__(self, bundle: Path, meta: dict):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(bundle) / meta["file"]
        if not path.is_file():
            raise SpecrtError(f"tokenizer file {path} is missing: export the bundle again")
        self.tok = HFTokenizer.from_file(str(path))
        self.meta = meta

    @cached_property
    def _template(self):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **kw: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.meta["chat_template"])

    @property
    def has_chat_template(self) -> bool:
        return bool(self.meta.get("chat_template"))

    def render_chat(self, messages: list[dict]) -> str:
        if not self.has_chat_template:
            raise SpecrtError("this bundle's tokenizer has no chat template: pass --raw")
        return self._template.render(messages=messages, add_generation_prompt=True,
                                     bos_token=self.meta.get("bos_token") or "",
                                     eos_token=self.meta.get("eos_token") or "")

    def encode_prompt(self, prompt: str, raw: bool = False) -> list[int]:
        """Token ids for a user prompt: chat-templated unless `raw` (then as the tokenizer encodes text)."""
        if raw:
            return self.tok.encode(prompt, add_special_tokens=True).ids
        return self.encode_chat([{"role": "user", "content": prompt}])

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered with the chat template (ending with the assistant's turn)."""
        return self.tok.encode(self.render_chat(messages), add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
