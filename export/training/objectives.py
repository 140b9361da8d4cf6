"""What every drafter kind's objective shares (each kind's spec names its objective, in the kind's
module export/drafters/<kind>.py, which documents what that kind learns).

Notation: x[t] tokens, h[t] the target's last hidden state, p[t] its next-token distribution (soft
labels: top-k, renormalized). Row r of a feature drafter reads x[r+1] and predicts x[r+2] ~ p[r+1];
`FeatureObjective` unrolls S steps, as drafted rows chain at run time ("training-time test" for
EAGLE, each step causal over its own rows for MTP).

Logits are computed over a label vocabulary (the most frequent target tokens, 8192 by default:
they cover ~99% of the target's top-1 choices), which cuts the LM-head cost several-fold; label
mass outside it is dropped. Every objective
also reports, per draft step, how often the drafter's top-1 equals the target's (answer tokens
only), and from those an estimate of τ for a chain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specrt.export.modeling import rope_cos_sin
from specrt.export.training.datagen import DistillData


def sharpen(p: torch.Tensor, temperature: float) -> torch.Tensor:
    """Soft labels p [..., k] at `temperature`: p^(1/T), renormalised to each row's own mass (a top-k list's,
    before the label vocabulary drops any). T < 1 moves mass toward the target's argmax (T -> 0: its one-hot,
    the label a greedy verify accepts), T = 1 leaves p as it is."""
    if temperature == 1.0:
        return p
    mass = p.sum(-1, keepdim=True)
    # in log space, from each row's largest entry: no power of a small p underflows to a row of zeros
    logp = p.clamp(min=1e-30).log() / temperature
    q = (logp - logp.amax(-1, keepdim=True)).exp().masked_fill(p <= 0, 0.0)
    return q / q.sum(-1, keepdim=True).clamp(min=1e-30) * mass


class Batch:
    """Right-padded sequences: tokens [B,T], hidden [B,T,H], aux, labels, `length` [B], `answer` [B,T].
    `hidden` is read from the store when an objective first asks for it: EAGLE-3's reads the tapped layers
    (aux) alone, and the final hidden states are a quarter of a store's feature bytes, which training
    otherwise streams from disk once a store outgrows the page cache. `label_temperature`: the soft labels
    sharpened (`sharpen`) before the label vocabulary drops what it lacks."""

    def __init__(self, data: DistillData, seqs: list[int], label_index: torch.Tensor, label_temperature: float = 1.0):
        lens = [data.seq(i).stop - data.seq(i).start for i in seqs]
        self.T = max(lens)
        self.length = torch.tensor(lens)
        self._data, self._seqs, self._hidden = data, seqs, None
        pad = self._pad
        self.tokens = pad("tokens")
        self.aux = pad("aux").float() if data.has_aux else None
        lab = label_index[pad("top_ids")]  # into the label vocabulary; -1: not in it
        self.label_top = lab[..., 0]
        self.label_p = sharpen(pad("top_p").float(), label_temperature).masked_fill(lab < 0, 0.0)
        self.label_ids = lab.clamp(min=0)
        pos = torch.arange(self.T)[None]
        self.valid = pos < self.length[:, None]
        self.answer = self.valid & (pos >= data.prompt_lens[seqs][:, None])

    def _pad(self, name: str, fill=0) -> torch.Tensor:
        rows = [self._data.fetch(name, i) for i in self._seqs]
        out = torch.full((len(rows), self.T, *rows[0].shape[1:]), fill, dtype=rows[0].dtype)
        for b, r in enumerate(rows):
            out[b, : len(r)] = r
        return out

    @property
    def hidden(self) -> torch.Tensor:
        if self._hidden is None:
            self._hidden = self._pad("hidden").float()
        return self._hidden


def soft_ce(logits: torch.Tensor, ids: torch.Tensor, p: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked rows of -Σ_k p_k log softmax(logits)[ids_k]."""
    logp = logits.float().log_softmax(-1)
    nll = -(logp.gather(-1, ids) * p).sum(-1)
    return (nll * mask).sum() / mask.sum().clamp(min=1)


TOP_K = 4  # how many of a draft step's best candidates top_hits counts the target's argmax among


def top1_hits(logits: torch.Tensor, top: torch.Tensor, mask: torch.Tensor) -> tuple[int, int]:
    """(rows where the drafter's argmax is the target's argmax `top`, rows) over `mask`."""
    return int(((logits.argmax(-1) == top) & mask).sum()), int(mask.sum())


def top_hits(logits: torch.Tensor, top: torch.Tensor, mask: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    """`top1_hits`, and the rows where `top` is among the drafter's k best, k = 1..TOP_K: what a draft step
    that proposes its k best candidates side by side (a tree's fan) would have accepted."""
    best = logits.topk(min(TOP_K, logits.shape[-1]), -1).indices
    found = ((best == top[..., None]).cumsum(-1) > 0) & mask[..., None]
    within = tuple(int(n) for n in found.sum(tuple(range(found.dim() - 1))))
    return within[0], int(mask.sum()), within


def shift_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """Row r of the result is row r+k of x (zero past the end)."""
    return torch.cat([x[:, k:], torch.zeros_like(x[:, :k])], 1)


def chain_tau(accs: list[float]) -> float:
    """τ estimate for a chain: 1 + a1 + a1·a2 + ... (each step's top-1 agreement, teacher-forced)."""
    tau, run = 1.0, 1.0
    for a in accs:
        run *= a
        tau += run
    return tau


class Objective:
    steps = 1

    def __init__(self, module, data: DistillData, label_vocab: torch.Tensor, steps: int | None = None):
        self.m, self.data = module, data
        self.vocab = label_vocab  # [|S|] target ids
        self.steps = steps or self.steps
        self.head_weight = None

    def sub_weight(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        if self.head_weight is None:
            self.head_weight = lm_head_weight.detach()[self.vocab]
        return self.head_weight

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """(loss, per-step (hits, rows)); a step's entry may add its top-k hits (`top_hits`)."""
        raise NotImplementedError


def ttt_mask(rows: int, step: int) -> torch.Tensor:
    """[rows, step·rows]: step `step` (1-based) row r sees real rows ≤ r-step+1 and, for each earlier
    unrolled step j ≥ 2, its row r-(step-j) (the drafted chain it extends), plus itself."""
    r = torch.arange(rows)[:, None]
    c = torch.arange(rows)[None, :]
    blocks = [c <= r - step + 1] + [c == r - (step - j) for j in range(2, step + 1)]
    return torch.cat(blocks, 1)


class FeatureObjective(Objective):
    steps = 3
    ttt = True  # attention as drafted rows see it (EAGLE); False: each step causal over its own rows (MTP)
    regress = 0.0
    answer_only = False  # True: the loss scores answer rows only (the rows drafted at run time), not the prompt's
    step_decay = 1.0  # step s's loss weighs step_decay**(s-1), normalised (1: the mean over steps)

    def module_for(self, step: int):
        return self.m

    def real_hidden(self, batch: Batch) -> torch.Tensor:
        return batch.hidden

    def head_weight_for(self, mod) -> torch.Tensor:
        return self.sub_weight(mod.lm_head.weight)

    def __call__(self, batch):
        rows = batch.T - 1
        ids = batch.tokens[:, 1:]  # row r reads x[r+1]
        lab_ids, lab_p = batch.label_ids[:, 1:], batch.label_p[:, 1:]  # and predicts x[r+2] ~ p[r+1]
        lab_top = batch.label_top[:, 1:]
        valid, answer = batch.valid[:, 1:], batch.answer[:, 1:]
        cos, sin = rope_cos_sin(self.m.dec, torch.arange(rows)[None])
        real = self.real_hidden(batch)[:, :rows]
        loss, hits, past, prev = 0.0, [], [], None
        causal = torch.tril(torch.ones(rows, rows, dtype=torch.bool))
        for s in range(1, self.steps + 1):
            mod = self.module_for(s - 1)
            hid = real if s == 1 else torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], 1)
            mask = ttt_mask(rows, s) if self.ttt else causal
            out, kv = mod.layer_train(ids, hid, cos, sin, past if self.ttt else [], mask)
            past.append(kv)
            logits = F.linear(mod.head_input(out), self.head_weight_for(mod))
            ok = valid.clone()
            ok[:, : s - 1] = False  # rows before the chain could start
            scored = ok & answer if self.answer_only else ok
            step_loss = soft_ce(logits, lab_ids, lab_p, scored)
            if self.regress:
                target = batch.hidden[:, 1 : rows + 1]
                err = F.smooth_l1_loss(out.float(), target, reduction="none").mean(-1)
                step_loss = step_loss + self.regress * (err * scored).sum() / scored.sum().clamp(min=1)
            loss = loss + (step_loss if self.step_decay == 1 else self.step_decay ** (s - 1) * step_loss)
            hits.append(top_hits(logits, lab_top, ok & answer) if s == 1 else top1_hits(logits, lab_top, ok & answer))
            prev = out
        weights = self.steps if self.step_decay == 1 else sum(self.step_decay**i for i in range(self.steps))
        return loss / weights, hits
