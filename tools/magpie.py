"""`specrt prompts`: prompts at scale written by the target itself (the Magpie method, arXiv 2406.08464).

An instruct model given its chat template up to where a user's words start, and nothing more, writes a user
turn: the kind of request it is trained to answer. Varying the system prompt, the temperature and the seed
gives many distinct prompts without a dataset hub, for `specrt distill --prompts FILE`.

Every written prompt

  - ended its turn (the model's end-of-turn token) within `max_new_tokens`: a cut-off one is dropped;
  - has at least MIN_WORDS words and no chat-template markup;
  - is neither the same (after normalising case, punctuation and spaces) nor a near duplicate (Jaccard
    similarity of word 3-grams ≥ `threshold`, found by MinHash with LSH bands) of a kept prompt or of any
    held-out prompt: the shipped corpus's held-out split, the benchmark set and the user's `--heldout` files,
    so nothing evaluated on is trained on;
  - goes to a held-out split of its own by a hash of its text (`heldout_share`), the rest to "train".

The output is JSONL, one prompt a line, appended as it is written: a rerun resumes after the last attempt
the file records (attempt i samples with seed `seed + i`), and a larger `count` extends the same file.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError

SENTINEL = "\u2063MAGPIE-USER-TURN\u2063"
SYSTEMS = (None, "You are a helpful assistant.", "You are a patient teacher who explains things step by step.",
           "You are an expert programmer.", "You are a maths tutor.", "You are a creative writing assistant.",
           "You are a concise assistant: answer in a few sentences.", "You are a knowledgeable science guide.",
           "You are an editor: you rewrite, shorten and correct the texts people give you.",
           "You are an assistant who answers with clear lists and steps.")
# `--systems NAME`: the system prompts attempts take in turn. "mixed" is every kind of request; the others lean
# the written user turns toward one kind the mixed set gives few of (a learned drafter accepts least on them)
SYSTEM_SETS = {
    "mixed": SYSTEMS,
    "science": ("You are a science teacher. Students ask you why things in nature happen.",
                "You are a physics tutor who answers questions about forces, energy, light and sound.",
                "You are a biology teacher who explains how plants, animals and cells work.",
                "You are a chemistry tutor who explains reactions, elements and everyday materials.",
                "You are an astronomy guide who answers questions about space, planets and stars.",
                "You are an Earth science teacher: weather, climate, oceans, rocks and volcanoes.",
                "You explain how everyday technology works: engines, batteries, phones and the internet.",
                "You are a health educator who explains how the human body works."),
    "writing": ("You are a creative writing assistant: people ask you for short stories and poems.",
                "You help people write emails, letters and messages for work and home.",
                "You write product descriptions, announcements and short articles on request.",
                "You are a speechwriter who drafts toasts, speeches and thank-you notes.",
                "You write haiku, limericks and short rhyming poems about any subject people name."),
    "facts": ("You answer quick factual questions in a sentence or two.",
              "You are a geography teacher: people ask you about countries, capitals, oceans and mountains.",
              "You are a history buff who answers questions about dates, people and events.",
              "You answer trivia questions about sports, animals, food and everyday things.",
              "You answer questions about numbers in daily life: measures, temperatures, distances and times."),
    "maths": ("You are a maths tutor who works through calculations step by step.",
              "You help with percentages, prices, discounts and money in everyday life.",
              "You convert units and temperatures and explain each step.",
              "You solve short word problems about time, speed, distance and sharing things out.",
              "You help students with fractions, decimals and mental arithmetic."),
}
TEMPERATURES = (0.7, 0.85, 1.0)
MIN_WORDS = 4
MARKUP = re.compile(r"<\|[^|]*\|>|<s>|</s>|\[INST\]")


def normalize(text: str) -> str:
    """Lower case, words only, single spaces: what makes two prompts the same."""
    return " ".join(re.findall(r"\w+", text.lower()))


def shingles(norm: str, n: int = 3) -> set[str]:
    words = norm.split()
    return {" ".join(words[i : i + n]) for i in range(max(1, len(words) - n + 1))}


def jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


class NearDuplicates:
    """Texts seen so far, answering whether a new one is the same as, or nearly the same as, one of them:
    MinHash signatures of word 3-grams, banded for candidates (LSH), each candidate checked by Jaccard."""

    PRIME = (1 << 61) - 1

    def __init__(self, threshold: float = 0.7, perms: int = 64, bands: int = 16, seed: int = 0):
        if perms % bands:
            raise SpecrtError(f"{perms} MinHash permutations do not split into {bands} bands")
        self.threshold, self.bands, self.rows = threshold, bands, perms // bands
        rng = np.random.default_rng(seed)
        self.a = rng.integers(1, 1 << 31, perms, dtype=np.uint64)
        self.b = rng.integers(0, 1 << 31, perms, dtype=np.uint64)
        self.exact: set[str] = set()
        self.sets: list[set[str]] = []
        self.buckets: dict[tuple[int, bytes], list[int]] = {}

    def _signature(self, grams: set[str]) -> np.ndarray:
        h = np.array([int.from_bytes(hashlib.blake2b(g.encode(), digest_size=4).digest(), "little") for g in grams],
                     dtype=np.uint64)
        return ((np.outer(h, self.a) + self.b) % np.uint64(self.PRIME)).min(axis=0)

    def _keys(self, sig: np.ndarray) -> list[tuple[int, bytes]]:
        return [(i, sig[i * self.rows : (i + 1) * self.rows].tobytes()) for i in range(self.bands)]

    def match(self, text: str) -> bool:
        """Is `text` the same as, or a near duplicate of, a text added before?"""
        norm = normalize(text)
        if norm in self.exact:
            return True
        grams = shingles(norm)
        seen: set[int] = set()
        for key in self._keys(self._signature(grams)):
            for j in self.buckets.get(key, ()):
                if j not in seen:
                    seen.add(j)
                    if jaccard(grams, self.sets[j]) >= self.threshold:
                        return True
        return False

    def add(self, text: str) -> None:
        norm = normalize(text)
        self.exact.add(norm)
        grams = shingles(norm)
        self.sets.append(grams)
        for key in self._keys(self._signature(grams)):
            self.buckets.setdefault(key, []).append(len(self.sets) - 1)


def pre_query(tokenizer, system: str | None) -> str:
    """The chat template rendered up to where a user's message starts (after `system`, if any)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": SENTINEL}]
    text = tokenizer.render_chat(messages)
    at = text.find(SENTINEL)
    if at < 0:
        raise SpecrtError("the bundle's chat template does not show the user's message: prompts cannot be "
                          "written from it")
    return text[:at]


def heldout_texts(files: Iterable[Path] = ()) -> list[str]:
    """Every prompt no generated prompt may repeat: the shipped corpus's held-out split, the benchmark set and
    the prompts of `files` (JSONL, {"prompt": ...} per line)."""
    from importlib import resources

    from specrt.export.training.corpus import load_prompts

    bench = Path(str(resources.files("specrt") / "data" / "bench_prompts.jsonl"))
    rows = load_prompts("heldout") + [p for f in (bench, *files) for p in load_prompts(None, Path(f))]
    return [p["prompt"] for p in rows]


def heldout_index(files: Iterable[Path] = (), threshold: float = 0.7) -> NearDuplicates:
    """Every held-out prompt (`heldout_texts`), indexed for the same-or-near-duplicate check."""
    index = NearDuplicates(threshold)
    for text in heldout_texts(files):
        index.add(text)
    return index


def _renders(tokenizer, system: str) -> bool:
    """Does the chat template take a system turn (some raise_exception on one)?"""
    try:
        pre_query(tokenizer, system)
    except SpecrtError:
        return False
    return True


@dataclass
class Written:
    attempt: int
    system: str | None
    temperature: float
    text: str
    finished: bool  # ended its turn


def verdict(w: Written, kept: NearDuplicates, heldout: NearDuplicates) -> str:
    """Why a written prompt is dropped ("" keeps it)."""
    if not w.finished:
        return "cut off"
    if len(w.text.split()) < MIN_WORDS:
        return "too short"
    if MARKUP.search(w.text):
        return "markup"
    if heldout.match(w.text):
        return "held-out duplicate"
    if kept.match(w.text):
        return "duplicate"
    return ""


def split_of(text: str, heldout_share: float) -> str:
    h = int(hashlib.sha256(normalize(text).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "heldout" if h < heldout_share else "train"


def read_existing(path: Path) -> list[dict]:
    """The rows a previous run wrote; a last line cut off mid-write is removed from the file."""
    if not path.is_file():
        return []
    raw = path.read_bytes()
    rows, good = [], 0
    for line in raw.split(b"\n"):
        if not line.strip():
            good += len(line) + 1
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
        good += len(line) + 1
    if good < len(raw):
        with open(path, "r+b") as f:
            f.truncate(min(good, len(raw)))
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not isinstance(row.get("attempt"), int):
            raise SpecrtError(f"{path} line {i + 1} is not a prompt this command wrote: write to another file")
    return rows


class Writer:
    """Writes prompts from a generator's target until `out` holds `count` (see the module doc)."""

    def __init__(self, gen, out: Path, heldout_files: Iterable[Path] = (), threshold: float = 0.7,
                 heldout_share: float = 0.02, seed: int = 0, systems: str = "mixed"):
        if systems not in SYSTEM_SETS:
            raise SpecrtError(f"--systems {systems!r}: choose one of {', '.join(SYSTEM_SETS)}")
        self.gen, self.out, self.seed, self.heldout_share = gen, Path(out), seed, heldout_share
        self.set_name = systems
        # ids unique across files: a set's own prefix, and a file of the same set with other seeds its own too
        # (seed 0 keeps the plain prefix, which the shipped files have)
        self.id_prefix = ("magpie" if systems == "mixed" else f"magpie-{systems}") + (f"-s{seed}" if seed else "")
        self.heldout = heldout_index(heldout_files, threshold)
        self.kept = NearDuplicates(threshold)
        self.rows = read_existing(self.out)
        other = {r.get("systems", "mixed") for r in self.rows} - {systems}
        if other:  # attempt i's system prompt is the set's (i mod its size): one file, one set
            raise SpecrtError(f"{self.out} was written with --systems {other.pop()}: extend it with that set, or "
                              f"write --systems {systems} to another file")
        for row in self.rows:
            self.kept.add(row["prompt"])
        self.next_attempt = 1 + max((r["attempt"] for r in self.rows), default=-1)
        self.dropped: dict[str, int] = {}
        tok = gen.tokenizer
        # a template may refuse a system turn
        self.systems = [s for s in SYSTEM_SETS[systems] if s is None or _renders(tok, s)]
        if not self.systems:
            raise SpecrtError(f"--systems {systems}: this bundle's chat template takes no system prompt")
        self.prefixes = [tok.tok.encode(pre_query(tok, s), add_special_tokens=False).ids for s in self.systems]

    def settings(self, attempt: int) -> tuple[str | None, float]:
        n = len(self.systems)
        return self.systems[attempt % n], TEMPERATURES[(attempt // n) % len(TEMPERATURES)]

    def write(self, attempt: int, result) -> Written:
        system, temperature = self.settings(attempt)
        text = self.gen.tokenizer.decode(result.token_ids).strip()
        return Written(attempt, system, temperature, text, result.finish_reason == "stop")

    def keep(self, w: Written) -> dict | None:
        why = verdict(w, self.kept, self.heldout)
        if why:
            self.dropped[why] = self.dropped.get(why, 0) + 1
            return None
        self.kept.add(w.text)
        row = {"id": f"{self.id_prefix}-{w.attempt}", "category": "magpie", "split": split_of(w.text, self.heldout_share),
               "prompt": w.text, "system": w.system, "temperature": w.temperature, "attempt": w.attempt}
        if self.set_name != "mixed":  # rows of the first files, written before there were sets, say nothing
            row["systems"] = self.set_name
        self.rows.append(row)
        return row

    def run(self, count: int, max_new_tokens: int = 96, slots: int = 1, max_attempts: int | None = None,
            progress: bool = True) -> dict:
        """Write until the file holds `count` prompts (or `max_attempts` more attempts were made)."""
        from tqdm import tqdm

        from specrt.runtime.sampling import SamplingParams

        limit = self.next_attempt + (max_attempts if max_attempts is not None else 50 * max(count, 1))
        bar = tqdm(total=count, initial=min(len(self.rows), count), desc="prompts", unit="prompt",
                   disable=not progress)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        with open(self.out, "a") as f:
            while len(self.rows) < count and self.next_attempt < limit:
                attempts = range(self.next_attempt, min(self.next_attempt + slots, limit))
                jobs = [(a, self.prefixes[a % len(self.systems)],
                         SamplingParams(temperature=self.settings(a)[1], top_p=0.95, seed=self.seed + a))
                        for a in attempts]
                for a, result in zip(attempts, self._generate(jobs, max_new_tokens), strict=True):
                    row = self.keep(self.write(a, result)) if len(self.rows) < count else None
                    if row is not None:
                        f.write(json.dumps(row) + "\n")
                        f.flush()
                        bar.update()
                self.next_attempt = attempts[-1] + 1
        bar.close()
        return {"prompts": len(self.rows), "attempts": self.next_attempt, "dropped": dict(self.dropped),
                "heldout": sum(r["split"] == "heldout" for r in self.rows)}

    def _generate(self, jobs, max_new_tokens: int) -> list:
        """Each job's result: one at a time, or batched through the serving scheduler where the generator has
        several KV slots (a seeded sample is the same either way)."""
        if self.gen.slots == 1 or len(jobs) == 1:
            return [self.gen.generate_ids(ids, max_new_tokens, sampling) for _, ids, sampling in jobs]
        from specrt.serving.scheduler import Scheduler

        scheduler = Scheduler(self.gen).start()
        try:
            handles = [scheduler.submit(ids, max_new_tokens, sampling) for _, ids, sampling in jobs]
            return [h.wait() for h in handles]
        finally:
            scheduler.stop()
