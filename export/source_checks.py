"""Checks of a source model before any weight is loaded: that its path is a model folder or a GGUF file (before
torch is imported), then its tokenizer against its config: ids the embedding has rows for, and a chat template
that parses. Either of the last two would otherwise export fine and fail at generate time."""

from __future__ import annotations

from pathlib import Path

from specrt.errors import SpecrtError
from specrt.runtime.tokenizer import syntax_error


def split_source(path: Path) -> tuple[str, dict]:
    """(pretrained path, extra from_pretrained kwargs) for a folder or a .gguf file; a path that is neither is
    refused here, before torch or transformers is imported (the CLI calls this first: an instant error)."""
    if not path.exists():
        raise SpecrtError(f"model path {path} does not exist: pass a Hugging Face model folder or a .gguf file")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise SpecrtError(f"{path} is a file but not a .gguf: pass a Hugging Face model folder or a .gguf file")
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise SpecrtError(f"{path} is not a GGUF file (bad magic bytes): the file is corrupt or of another format")
        return str(path.parent), {"gguf_file": path.name}
    if not (path / "config.json").is_file():
        raise SpecrtError(f"{path} has no config.json: pass a Hugging Face model folder or a .gguf file")
    return str(path), {}


def source_files(path: Path) -> dict[str, Path]:
    """Where a folder's (or a GGUF's) config, tokenizer and chat template come from, for messages."""
    if path.is_file():  # a .gguf holds all three
        return dict.fromkeys(("config", "tokenizer", "chat_template"), path)
    tokenizer = path / "tokenizer.json"
    template = path / "chat_template.jinja"
    return {"config": path / "config.json", "tokenizer": tokenizer if tokenizer.is_file() else path,
            "chat_template": template if template.is_file() else path / "tokenizer_config.json"}


def check_tokenizer(path: Path, hf_config, tokenizer) -> None:
    """Refuse a tokenizer with ids >= the config's vocab_size (fewer tokens than embedding rows is normal:
    embeddings are often padded) and a chat template that does not parse."""
    files = source_files(Path(path))
    vocab = tokenizer.get_vocab()
    top = max(vocab.values(), default=-1)
    if top >= hf_config.vocab_size:
        raise SpecrtError(f"the tokenizer {files['tokenizer']} has {len(vocab)} tokens (ids up to {top}) but "
                          f"{files['config']} sets vocab_size {hf_config.vocab_size}: the embedding has no row for "
                          f"ids >= {hf_config.vocab_size}; fix vocab_size (at least {top + 1}) or use the model's "
                          "own tokenizer")
    template = getattr(tokenizer, "chat_template", None)
    error = syntax_error(template) if isinstance(template, str) and template else None
    if error:
        raise SpecrtError(f"the chat template in {files['chat_template']} is not a valid Jinja template ({error}): "
                          "fix it, or remove it and generate with --raw")
