"""Requests about a given text (rewrite, summarise, simplify, make formal or polite, list, correct), built from
passages of prose: the kind of prompt a chat model is asked every day that the model rarely writes for itself.

Of the first 9,500 Magpie prompts the default model wrote, 31 asked to rewrite, summarise or correct a text, and
the learned drafter accepted least on exactly those requests. Here each passage (a paragraph of MIN_WORDS to
MAX_WORDS words of prose) becomes one request about it, the kind by a hash of the passage so a rerun writes the
same file. The passages come from

  - a distillation store's answers (`specrt distill`): the target's own prose, decoded with the bundle's
    tokenizer; answers of the store's held-out split are never used;
  - text files (.txt, .md): paragraphs split at blank lines.

Prompts that repeat a kept one or any held-out prompt (exactly or nearly, magpie.NearDuplicates) are dropped, and
so is a passage that nearly repeats a kept passage under another request; a share goes to a held-out split of
their own.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError
from specrt.tools.magpie import NearDuplicates, heldout_index, split_of

MIN_WORDS, MAX_WORDS = 25, 120  # a passage's size: a paragraph, not a line or a page
TEXT_SUFFIXES = (".txt", ".md")
_NOT_PROSE = re.compile(r"```|^\s*(?:[-*•]|\d+[.)])\s|^\s*#|\|.*\||[{}<>=]{2}|https?://|`|:\s*$", re.M)
# an assistant talking about itself ("I'd be happy to help", "as an AI"): chat filler, not a text to work on
_SPEECH = re.compile(r"^(?:I\b|I'|Sure\b|Certainly\b|Of course\b|Absolutely\b|Great\b|Hello\b|Hi\b)|\bas an? (?:\w+ )?AI\b|"
                     r"\bI'm (?:here|sorry|designed|not able|unable)|\blanguage model\b|\bassist(?:ance)? you\b", re.I)

# request kinds: (name, the request with the passage in {text})
TASKS = (
    ("simplify", "Rewrite this in simpler English:\n\n{text}"),
    ("summary", "Summarize this in one sentence:\n\n{text}"),
    ("formal", "Make this text sound more formal:\n\n{text}"),
    ("casual", "Rewrite this in a friendly, casual tone:\n\n{text}"),
    ("shorten", "Shorten this paragraph to half its length, keeping the main points:\n\n{text}"),
    ("bullets", "Turn this paragraph into a bulleted list:\n\n{text}"),
    ("correct", "Correct any grammar or spelling mistakes in this text and improve its flow:\n\n{text}"),
    ("past", "Rewrite this passage in the past tense:\n\n{text}"),
    ("title", "Suggest a short title for this text:\n\n{text}"),
    ("child", "Explain this to a ten-year-old:\n\n{text}"),
    ("keypoints", "What are the three key points of this text?\n\n{text}"),
    ("paraphrase", "Paraphrase this paragraph in your own words:\n\n{text}"),
)


def is_prose(text: str) -> bool:
    """A paragraph of MIN..MAX words of running text: no code, list items, headings, tables, links or lead-ins to a list, and not an
    assistant speaking of itself."""
    return (MIN_WORDS <= len(text.split()) <= MAX_WORDS and not _NOT_PROSE.search(text) and text.count("\n") <= 2
            and not _SPEECH.search(text))


def paragraphs(text: str) -> Iterator[str]:
    """The prose paragraphs of `text` (split at blank lines), whitespace normalised."""
    for block in re.split(r"\n\s*\n", text):
        block = " ".join(block.split()) if "\n" in block.strip() else block.strip()
        if is_prose(block):
            yield block


def store_answers(root: Path, tokenizer) -> Iterator[str]:
    """The decoded answers of distillation store `root`'s training split (each sequence's tokens after its
    prompt), shard by shard."""
    from specrt.export.training.store_format import check_store

    root = Path(root)
    meta = check_store(root)
    if meta is None:
        raise SpecrtError(f"--from {root}: not a distillation store (no meta.json) nor a text file")
    for shard in meta["shards"]:
        folder = root / shard["name"]
        tokens = np.load(folder / "tokens.npy", mmap_mode="r")
        offsets, prompt_lens = np.load(folder / "offsets.npy"), np.load(folder / "prompt_lens.npy")
        heldout = np.load(folder / "heldout.npy")
        for i in range(len(offsets) - 1):
            if not heldout[i]:
                yield tokenizer.decode(np.asarray(tokens[offsets[i] + prompt_lens[i] : offsets[i + 1]]).tolist())


def passages(sources: Iterable[Path], tokenizer=None) -> Iterator[tuple[str, str]]:
    """(source name, passage) from each source in turn: a store folder (needs `tokenizer`) or a text file."""
    for src in sources:
        src = Path(src)
        if src.is_dir():
            if tokenizer is None:
                raise SpecrtError(f"--from {src}: a store's answers are decoded with a bundle's tokenizer: name one")
            texts = store_answers(src, tokenizer)
        elif src.is_file() and src.suffix in TEXT_SUFFIXES:
            texts = iter([src.read_text(encoding="utf-8", errors="replace")])
        else:
            raise SpecrtError(f"--from {src}: give a distillation store folder or a text file "
                              f"({', '.join(TEXT_SUFFIXES)})")
        for n, text in enumerate(texts):
            for para in paragraphs(text):
                yield f"{src.name}:{n}", para


def text_prompts(found: Iterable[tuple[str, str]], count: int, seed: int = 0, heldout_files: Iterable[Path] = (),
                 threshold: float = 0.7, heldout_share: float = 0.02) -> tuple[list[dict], dict]:
    """Up to `count` prompt rows (ids text-N) from (source, passage) pairs, shuffled by `seed`, and a summary of
    what was dropped and why. At most one passage per source text, so no answer is rewritten twice."""
    pool: dict[str, str] = {}
    for where, para in found:
        pool.setdefault(where, para)
    order = sorted(pool)
    random.Random(seed).shuffle(order)
    held, kept, seen = heldout_index(heldout_files, threshold), NearDuplicates(threshold), NearDuplicates(threshold)
    rows, dropped = [], {"held-out duplicate": 0, "duplicate": 0}
    for where in order:
        if len(rows) >= count:
            break
        para = pool[where]
        name, template = TASKS[hashlib.sha256(f"{seed}:{para}".encode()).digest()[0] % len(TASKS)]
        prompt = template.format(text=para)
        why = ("held-out duplicate" if held.match(prompt) or held.match(para)
               else "duplicate" if kept.match(prompt) or seen.match(para) else "")
        if why:
            dropped[why] += 1
            continue
        kept.add(prompt)
        seen.add(para)
        rows.append({"id": f"text-{len(rows) + 1}", "category": "rewrite", "split": split_of(prompt, heldout_share),
                     "prompt": prompt, "task": name, "source": where})
    return rows, {"written": len(rows), "passages": len(pool), "dropped": dropped}
