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


def compile_template(text: str):
    """The chat template as transformers renders it; jinja2.TemplateSyntaxError when it does not parse."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **kw: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = _raise
    return env.from_string(text)


def syntax_error(text: str) -> str | None:
    """Why the chat template `text` does not parse ("line 3: unexpected '}'"), or None when it does."""
    from jinja2 import TemplateSyntaxError

    try:
        compile_template(text)
    except TemplateSyntaxError as e:
        return f"line {e.lineno}: {e.message}"
    return None


class Tokenizer:
    def __init__(self, bundle: Path, meta: dict):
        """The bundle's tokenizer file and chat template, both checked here: a bad one names its file."""
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(bundle) / meta["file"]
        if not path.is_file():
            raise SpecrtError(f"tokenizer file {path} is missing: export the bundle again")
        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for unparsable files
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise SpecrtError(f"{path} is not a valid tokenizer file ({why}): "
                              "re-export the bundle (or copy its tokenizer folder again)") from None
        self.meta = meta
        error = syntax_error(meta["chat_template"]) if self.has_chat_template else None
        if error:
            raise SpecrtError(f"{Path(bundle) / 'manifest.json'}: tokenizer.chat_template is not a valid Jinja "
                              f"template ({error}): fix the source model's chat template and re-export the bundle")

    @cached_property
    def _template(self):
        return compile_template(self.meta["chat_template"])

    @cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token decodes to: a text of more characters than n × this cannot be
        fewer than n tokens, whatever it tokenizes to."""
        tok = self.tok
        return max(len(tok.decode([i], skip_special_tokens=False).encode()) for i in range(tok.get_vocab_size()))

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
