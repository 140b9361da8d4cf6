"""The target's answers at scale: continuous batching over KV slots in PyTorch, on a CPU.

Every slot holds one sequence. A decode pass runs all slots at once (one new row each); a slot whose
answer ends takes the next job at once (its prompt prefilled alone, in the slot's own KV rows), so
the batch stays full while answers of different lengths finish. Per position the slot records the
token, the target's last hidden state and tapped-layer inputs (fp16) and its top-k next-token
distribution: the rows `store.ShardWriter` keeps.

Precision: with `int8` (the default for data at scale) every linear layer is quantized dynamically
(the int8 kernels of torch's quantized engine — x86/fbgemm on x86-64 unless forced, see
precision.py — ~1.7x fp32 on an AVX2 CPU); the deployed int4 target is itself a quantization of the
same weights, so the drafter learns from a target as close to it as fp32 is. `fp32` runs the exported
weights as they are. Dynamic int8 quantizes a pass's activations with one scale for the whole pass,
so an int8 row depends on the other rows of its batch (a few % of the row's range on a tiny model);
fp32 rows differ only by the kernels' rounding (tests/export/test_distill.py derives both bounds).
"""

from __future__ import annotations

import copy
import math
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from specrt.export.training.datagen import TOP_K, _top


@dataclass(frozen=True)
class Job:
    id: str  # unique within a store: "ROUND:PROMPT_ID"
    prompt: list[int]
    temperature: float  # 0: greedy
    heldout: bool

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode())


# How far a batched pass's stored rows may lie from the same rows computed one sequence at a time,
# per compute precision (tests/export/test_distill.py asserts it for every branch):
#   storage: each side rounds to fp16, within half an ulp (2^-11 of |x|): one ulp apart, 2^-10 of |x|.
#   compute: the passes differ by rounding only. Per layer and per residual block (attention, MLP) a
#   row moves by u of the row's largest |x|: fp32, kernels for M rows and for 1 row may sum a dot
#   product of width K in other orders, u = sqrt(K)·2^-24 (rounding as a random walk); int8, one
#   activation scale per pass, u = 2^-7 (half a 7-bit step of the range, fbgemm's reduced range,
#   on each side).
FP16_STORE_RTOL = 2**-10
MAX_PROMPT = 512  # prompt rows a slot takes; longer prompts are skipped
BATCH_NOISE = {"fp32": lambda width: math.sqrt(width) * 2**-24, "int8": lambda width: 2**-7}


def batch_tolerance(precision: str, layers: int, width: int) -> tuple[float, float]:
    """(rtol of |x|, atol as a share of the row's largest |x|) between batched and one-at-a-time rows
    of a `layers`-deep target whose widest matmul sums `width` terms, at compute `precision`."""
    return FP16_STORE_RTOL, 2 * layers * BATCH_NOISE[precision](width)


def quantized(module: torch.nn.Module, precision: str) -> torch.nn.Module:
    """A copy of `module` for generation at `precision` ("fp32" or "int8": dynamic int8 linears)."""
    if precision == "fp32":
        return module
    if precision != "int8":
        raise ValueError(f"unknown data precision {precision!r}: choose fp32 or int8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(copy.deepcopy(module), {torch.nn.Linear}, dtype=torch.qint8)


class _Slot:
    def __init__(self, capacity: int, hidden: int, aux: int):
        self.job: Job | None = None
        self.tokens = np.zeros(capacity, np.int32)
        self.hidden = np.zeros((capacity, hidden), np.float16)
        self.aux = np.zeros((capacity, aux), np.float16)
        self.top_ids = np.zeros((capacity, TOP_K), np.int32)
        self.top_p = np.zeros((capacity, TOP_K), np.float16)
        self.n = 0  # tokens so far; rows 0..n-2 have state (the newest token not fed yet)
        self.rng: torch.Generator | None = None

    def record(self, row: int, hidden, aux, ids, p) -> None:
        self.hidden[row : row + len(hidden)] = hidden
        self.aux[row : row + len(aux)] = aux
        self.top_ids[row : row + len(ids)] = ids
        self.top_p[row : row + len(p)] = p

    def fields(self) -> dict[str, np.ndarray]:
        n = self.n - 1  # the last token was never fed: no state for it
        return {"tokens": self.tokens[:n].copy(), "hidden": self.hidden[:n].copy(), "aux": self.aux[:n].copy(),
                "top_ids": self.top_ids[:n].copy(), "top_p": self.top_p[:n].copy()}


class TorchPasses:
    """`answer_jobs`'s passes on a torch DecoderLM: `slots` sequences of KV, `capacity` rows each."""

    def __init__(self, module, slots: int, capacity: int, taps: tuple[int, ...]):
        self.module, self.taps = module, taps
        self.cfg = module.cfg
        self.kv = module.new_kv(slots, capacity)

    def prefill(self, b: int, prompt: list[int]):
        """Slot `b` takes `prompt` from row 0: (logits [t, V], hidden [t, H] fp16, aux [t, A] fp16)."""
        t = len(prompt)
        view = [(k[b : b + 1], v[b : b + 1]) for k, v in self.kv]
        logits, hidden, aux = self.module(torch.tensor([prompt]), torch.arange(t)[None], torch.tensor([0]),
                                          torch.tril(torch.ones(t, t, dtype=torch.bool))[None], view, taps=self.taps)
        return logits[0], hidden[0].half().numpy(), aux[0].half().numpy()

    def decode(self, lo: int, hi: int, ids: list[int], past: list[int]):
        """One row for each slot lo..hi-1 (token `ids[i]` at position `past[i]`): logits [n, V], hidden, aux."""
        past_t = torch.tensor(past)
        view = [(k[lo:hi], v[lo:hi]) for k, v in self.kv]
        logits, hidden, aux = self.module(torch.tensor(ids)[:, None], past_t[:, None], past_t,
                                          torch.ones(hi - lo, 1, 1, dtype=torch.bool), view, taps=self.taps)
        return logits[:, 0], hidden[:, 0].half().numpy(), aux[:, 0].half().numpy()


@torch.no_grad()
def answer_jobs(passes, jobs: Iterator[Job], max_new_tokens: int, taps: tuple[int, ...],
                on_done: Callable[[Job, dict, int], None], slots: int = 64, max_prompt: int = MAX_PROMPT,
                stop: Callable[[], bool] = lambda: False, progress: tqdm | None = None) -> int:
    """Answer `jobs` with `slots` sequences in flight; `on_done(job, fields, prompt_len)` per finished
    one. `passes`: a torch DecoderLM, or an object with `cfg`, `prefill` and `decode` as `TorchPasses`
    (native_answers.NativePasses: the bundle's int4 target on the native kernels), built for `slots`
    slots of `max_prompt + max_new_tokens + 1` rows. Stops taking jobs when they run out or `stop()`
    says so; returns the answer tokens made."""
    capacity = max_prompt + max_new_tokens + 1
    if isinstance(passes, torch.nn.Module):
        passes = TorchPasses(passes, slots, capacity, taps)
    cfg = passes.cfg
    aux_size = len(taps) * cfg.hidden_size
    pool = [_Slot(capacity, cfg.hidden_size, aux_size) for _ in range(slots)]
    eos = set(cfg.eos_token_ids)
    made, exhausted = 0, False

    def choose(slot: _Slot, logits: torch.Tensor) -> int:
        if slot.job.temperature <= 0:
            return int(logits.argmax())
        p = (logits.float() / slot.job.temperature).softmax(-1)
        return int(torch.multinomial(p, 1, generator=slot.rng))

    def start(b: int, job: Job) -> None:
        slot = pool[b]
        slot.job, slot.n = job, len(job.prompt)
        slot.rng = torch.Generator().manual_seed(job.seed)
        slot.tokens[: slot.n] = job.prompt
        logits, hidden, aux = passes.prefill(b, job.prompt)
        ids, p = _top(logits)
        slot.record(0, hidden, aux, ids.numpy(), p.half().numpy())
        slot.tokens[slot.n] = choose(slot, logits[-1])
        slot.n += 1

    def finished(slot: _Slot) -> bool:
        answer = slot.n - len(slot.job.prompt)
        return int(slot.tokens[slot.n - 1]) in eos or answer >= max_new_tokens

    def refill() -> None:
        nonlocal exhausted
        for b, slot in enumerate(pool):
            while slot.job is None and not exhausted:
                if stop():
                    exhausted = True
                    break
                job = next(jobs, None)
                if job is None:
                    exhausted = True
                    break
                if not job.prompt or len(job.prompt) > max_prompt:
                    continue  # outside the slot's room; the caller counts what it submitted
                start(b, job)

    def retire(b: int) -> None:
        nonlocal made
        slot = pool[b]
        made += slot.n - len(slot.job.prompt)
        on_done(slot.job, slot.fields(), len(slot.job.prompt))
        if progress is not None:
            progress.update(slot.n - len(slot.job.prompt))
        slot.job = None

    refill()
    t0 = shown = time.perf_counter()
    while any(s.job is not None for s in pool):
        for b, slot in enumerate(pool):
            if slot.job is not None and finished(slot):
                retire(b)
        refill()
        live = [b for b, s in enumerate(pool) if s.job is not None]
        if not live:
            break
        lo, hi = live[0], live[-1] + 1  # one pass over the contiguous range of slots in use
        ids = [int(pool[b].tokens[pool[b].n - 1]) if pool[b].job else 0 for b in range(lo, hi)]
        past = [pool[b].n - 1 if pool[b].job else 0 for b in range(lo, hi)]
        logits, hidden, aux = passes.decode(lo, hi, ids, past)
        top_ids, top_p = _top(logits)
        top_ids, top_p = top_ids.numpy(), top_p.half().numpy()
        for b in live:
            slot, r = pool[b], b - lo
            slot.record(slot.n - 1, hidden[r : r + 1], aux[r : r + 1], top_ids[r : r + 1], top_p[r : r + 1])
            slot.tokens[slot.n] = choose(slot, logits[r])
            slot.n += 1
        if progress is not None and time.perf_counter() - shown > 5:
            shown = time.perf_counter()
            live_made = made + sum(pool[b].n - len(pool[b].job.prompt) for b in live)
            progress.set_postfix(slots=len(live), tok_s=f"{live_made / (shown - t0):.0f}", refresh=False)
    return made
