"""Checks of a source model before any weight is loaded: that its path is a model folder or a GGUF file (before
torch is imported), then its tokenizer against its config: ids the embedding has rows for, and a chat template
that parses. Either of the last two would otherwise export fine and fail at generate time.

For a folder, `check_folder_source` makes the checks its files allow before torch and transformers are imported
(seconds on a small machine): the family, the tokenizer's ids against vocab_size, the chat template, weights
that are not safetensors, and a draft model's vocabulary against the target's. Each refuses only what the load
would refuse later with the same message; what a file alone cannot say is left to the load."""

from __future__ import annotations

import json
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
    _check_vocab(files, tokenizer.get_vocab(), hf_config.vocab_size)
    _check_template(files, getattr(tokenizer, "chat_template", None))


def _check_vocab(files: dict[str, Path], vocab: dict[str, int], vocab_size: int) -> None:
    top = max(vocab.values(), default=-1)
    if top >= vocab_size:
        raise SpecrtError(f"the tokenizer {files['tokenizer']} has {len(vocab)} tokens (ids up to {top}) but "
                          f"{files['config']} sets vocab_size {vocab_size}: the embedding has no row for "
                          f"ids >= {vocab_size}; fix vocab_size (at least {top + 1}) or use the model's own tokenizer")


def _check_template(files: dict[str, Path], template) -> None:
    error = syntax_error(template) if isinstance(template, str) and template else None
    if error:
        raise SpecrtError(f"the chat template in {files['chat_template']} is not a valid Jinja template ({error}): "
                          "fix it, or remove it and generate with --raw")


def check_folder_source(path: Path) -> dict | None:
    """The checks a model folder's own files allow, before torch is imported (a .gguf is parsed by the load and
    is left to it). Returns the folder's config.json values (None for a file, or a config the load must read)."""
    from specrt.export.archs import arch_for
    from specrt.export.safetensors_file import check_folder

    if path.is_file():
        return None
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None  # the load's own error names what is wrong with it
    if not isinstance(config, dict):
        return None
    if isinstance(config.get("model_type"), str):
        arch_for(config["model_type"])
    files = source_files(path)
    vocab_size = config.get("vocab_size")
    if isinstance(vocab_size, int) and files["tokenizer"].is_file():
        vocab = _tokenizer_file_vocab(files["tokenizer"])
        if vocab is not None:  # the load's tokenizer holds these ids and maybe more: it refuses whatever this does
            _check_vocab(files, vocab, vocab_size)
    _check_template(files, _template_text(files["chat_template"]))
    check_folder(path, "re-download the model, or convert its weights to safetensors in a trusted environment")
    return config


def check_same_vocab(target_vocab, draft_vocab, draft_source) -> None:
    """A draft model with another vocab_size than the target's is refused (the CLI from the folders' configs,
    before torch; the export from the loaded models). A size not known yet (None) is left to the load."""
    if isinstance(target_vocab, int) and isinstance(draft_vocab, int) and target_vocab != draft_vocab:
        raise SpecrtError(f"draft vocab {draft_vocab} != target vocab {target_vocab} ({draft_source}): "
                          "the drafter must share the target's tokenizer")


def _tokenizer_file_vocab(path: Path) -> dict[str, int] | None:
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    except Exception:  # a file the tokenizers library cannot read: transformers' load reports it
        return None


def _template_text(path: Path):
    """The chat template transformers would read from `path` (chat_template.jinja, or tokenizer_config.json's
    chat_template where that is one string); None where there is none or it cannot be read here."""
    try:
        text = path.read_text(encoding="utf-8")
        return text if path.suffix == ".jinja" else json.loads(text).get("chat_template")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
