"""Self-distillation data: the target answers the corpus prompts (greedy, fp32) and every position's
target state is cached once, in a safetensors file every drafter kind trains from.

Per position t of each sequence (prompt + answer) the cache holds:
    tokens     x[t]
    hidden     h[t]: the target's last hidden state (after the final norm), fp16
    aux        inputs of the tap layers, concatenated (EAGLE-3's features), fp16
    top_ids, top_p   the target's top-k next-token distribution at t (renormalized), for soft labels
Sequences are generated in batches with one KV cache per row (rows at different lengths), so the
whole corpus takes minutes on a CPU.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specrt.export.loading import LoadedModel
from specrt.export.modeling import DecoderLM

TOP_K = 16


@dataclass
class DistillData:
    tokens: torch.Tensor  # [N] int64, all sequences concatenated
    offsets: torch.Tensor  # [S+1] int64: sequence i is tokens[offsets[i]:offsets[i+1]]
    prompt_lens: torch.Tensor  # [S] int64
    hidden: torch.Tensor  # [N, H] fp16
    aux: torch.Tensor  # [N, n_taps*H] fp16
    top_ids: torch.Tensor  # [N, K] int64
    top_p: torch.Tensor  # [N, K] fp32
    taps: tuple[int, ...]
    heldout: torch.Tensor  # [S] bool

    def __len__(self) -> int:
        return len(self.prompt_lens)

    @classmethod
    def from_sequences(cls, seqs: list[tuple], prompt_lens: list[int], heldout: list[bool], taps) -> DistillData:
        """From `generate`'s per-sequence tuples (tokens, hidden, aux, top_ids, top_p)."""
        lens = [len(s[0]) for s in seqs]
        return cls(tokens=torch.cat([s[0] for s in seqs]),
                   offsets=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]),
                   prompt_lens=torch.tensor(prompt_lens), hidden=torch.cat([s[1] for s in seqs]),
                   aux=torch.cat([s[2] for s in seqs]), top_ids=torch.cat([s[3] for s in seqs]),
                   top_p=torch.cat([s[4] for s in seqs]), taps=tuple(taps), heldout=torch.tensor(heldout))

    def seq(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    def fetch(self, name: str, i: int) -> torch.Tensor:
        """Field `name` of sequence i (the interface `store.MappedData` shares)."""
        return getattr(self, name)[self.seq(i)]

    @property
    def has_aux(self) -> bool:
        return self.aux.numel() > 0

    def top_counts(self, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(how often each id is the target's top-1, how often it is in the top-k lists)."""
        return (torch.bincount(self.top_ids[:, 0], minlength=vocab_size)[:vocab_size].float(),
                torch.bincount(self.top_ids.flatten(), minlength=vocab_size)[:vocab_size].float())

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        tmp = path.with_suffix(".tmp")
        save_file({"tokens": self.tokens, "offsets": self.offsets, "prompt_lens": self.prompt_lens,
                   "hidden": self.hidden, "aux": self.aux, "top_ids": self.top_ids.int(),
                   "top_p": self.top_p.half(), "heldout": self.heldout},
                  str(tmp), metadata={"taps": json.dumps(list(self.taps))})
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> DistillData:
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), "pt") as f:
            taps = tuple(json.loads(f.metadata()["taps"]))
        t = load_file(str(path))
        return cls(tokens=t["tokens"], offsets=t["offsets"], prompt_lens=t["prompt_lens"], hidden=t["hidden"],
                   aux=t["aux"], top_ids=t["top_ids"].long(), top_p=t["top_p"].float(), taps=taps,
                   heldout=t["heldout"].bool())


def encode(loaded: LoadedModel, prompt: str) -> list[int]:
    ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
    return list(ids)


def _top(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    p = logits.float().softmax(-1)
    vals, ids = p.topk(TOP_K, -1)
    return ids, vals / vals.sum(-1, keepdim=True)


@torch.no_grad()
def generate(module: DecoderLM, prompts: list[list[int]], max_new_tokens: int, taps: tuple[int, ...],
             batch_size: int = 32, progress: bool = True):
    """Greedy answers for `prompts`; yields per sequence (tokens, hidden, aux, top_ids, top_p)."""
    cfg = module.cfg
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: dict[int, tuple] = {}
    bar = tqdm(total=len(prompts), desc="distill data", unit="seq", disable=not progress)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        cap = max(len(prompts[i]) for i in rows) + max_new_tokens + 1
        kv = module.new_kv(len(rows), cap)
        rec = [{"tok": list(prompts[i]), "h": [], "a": [], "ti": [], "tp": []} for i in rows]
        nxt = []
        for b, i in enumerate(rows):  # prefill each row on its own (no padding)
            ids = torch.tensor([prompts[i]])
            t = ids.shape[1]
            view = [(k[b : b + 1], v[b : b + 1]) for k, v in kv]
            logits, hidden, aux = module(ids, torch.arange(t)[None], torch.tensor([0]),
                                         torch.tril(torch.ones(t, t, dtype=torch.bool))[None], view, taps=taps)
            ti, tp = _top(logits[0])
            rec[b]["h"].append(hidden[0].half())
            rec[b]["a"].append(aux[0].half())
            rec[b]["ti"].append(ti)
            rec[b]["tp"].append(tp)
            nxt.append(int(logits[0, -1].argmax()))
        done = [False] * len(rows)
        for _ in range(max_new_tokens):
            for b, tok in enumerate(nxt):
                if not done[b]:
                    rec[b]["tok"].append(tok)
                    done[b] = tok in cfg.eos_token_ids or len(rec[b]["tok"]) - len(prompts[rows[b]]) >= max_new_tokens
            if all(done):
                break
            past = torch.tensor([len(r["tok"]) - 1 for r in rec])
            ids = torch.tensor([[r["tok"][-1]] for r in rec])
            logits, hidden, aux = module(ids, past[:, None], past, torch.ones(len(rows), 1, 1, dtype=torch.bool), kv,
                                         taps=taps)
            ti, tp = _top(logits[:, 0])
            for b, r in enumerate(rec):
                if not done[b]:
                    r["h"].append(hidden[b].half())
                    r["a"].append(aux[b].half())
                    r["ti"].append(ti[b : b + 1])
                    r["tp"].append(tp[b : b + 1])
            nxt = logits[:, 0].argmax(-1).tolist()
        for b, i in enumerate(rows):
            r = rec[b]
            n = len(r["tok"]) - 1  # the last token was never fed: no state for it
            results[i] = (torch.tensor(r["tok"][:n]), torch.cat(r["h"])[:n], torch.cat(r["a"])[:n],
                          torch.cat(r["ti"])[:n], torch.cat(r["tp"])[:n])
        bar.update(len(rows))
    bar.close()
    return [results[i] for i in range(len(prompts))]


def cache_key(source: str, prompts: list[dict], max_new_tokens: int, taps) -> str:
    src = Path(source)
    stat = f"{src.resolve()}:{src.stat().st_size}" if src.exists() else source
    blob = json.dumps([stat, [p["prompt"] for p in prompts], max_new_tokens, list(taps)])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_data(loaded: LoadedModel, prompts: list[dict], max_new_tokens: int, taps: tuple[int, ...],
               cache_dir: Path | None = None, progress: bool = True) -> DistillData:
    """Generate (or reuse the cached) distillation data for `prompts`."""
    path = None
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        path = cache_dir / f"distill-{cache_key(loaded.source, prompts, max_new_tokens, taps)}.safetensors"
        if path.is_file():
            return DistillData.load(path)
    encoded = [encode(loaded, p["prompt"]) for p in prompts]
    seqs = generate(loaded.module, encoded, max_new_tokens, taps, progress=progress)
    data = DistillData.from_sequences(seqs, [len(e) for e in encoded], [p["split"] == "heldout" for p in prompts],
                                      taps)
    if path is not None:
        data.save(path)
    return data
