"""`specrt train`: build the distillation data once, then train one drafter kind on it.

Stopping is by epochs (deterministic for a seed); `max_minutes` is a guard that cuts a run short
(a cut run says so in its metrics). Mixed precision where the CPU computes bf16 natively (AVX-512
BF16, AMX, Arm BF16): bf16 autocast, fp32 weights and optimizer; elsewhere fp32 throughout — on an
AVX2-only CPU bf16 matmuls are emulated and ~50× slower than fp32. `TrainSettings.precision` (or
SPECRT_TRAIN_PRECISION) forces either (export/training/precision.py); the metrics say which ran and why.
The held-out prompts (every 6th of each category) are never trained on; they give the per-step
top-1 agreement and τ estimate recorded in `metrics.json` (a curve over training time) and plotted.
`epochs` 0 with `init` takes no step: the warm start saved over this data's draft vocabulary and
evaluated (how the shipped EAGLE-3 head's vocabulary was cut to 4,096: docs/training.md).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from specrt.errors import SpecrtError
from specrt.export import drafters
from specrt.export.drafters.base import default_taps
from specrt.export.loading import LoadedModel
from specrt.export.training import checkpoint
from specrt.export.training.datagen import DistillData, build_data
from specrt.export.training.objectives import Batch, chain_tau
from specrt.export.training.precision import METRICS_NAME, aten_dispatch, autocast, train_precision
from specrt.export.training.report import plot_curves
from specrt.kinds import resolve


@dataclass
class TrainSettings:
    kind: str
    epochs: float = 4.0
    max_minutes: float = 20.0
    batch_seqs: int = 4
    lr: float | None = None
    steps: int | None = None  # unrolled draft steps (eagle, eagle3, mtp)
    seed: int = 0
    evals: int = 8  # held-out evaluations over the run (the τ curve)
    draft_vocab: int = 8192  # label vocabulary: the most frequent target tokens (the draft vocabulary, where kept)
    max_new_tokens: int = 160
    max_prompts: int | None = None  # use the first N corpus prompts (tests, quick runs)
    precision: str = "auto"  # auto | bf16 | fp32 (export/training/precision.py)
    save_dtype: str = "fp32"  # the checkpoint's weights: fp32, or fp16 (half the size: a committed drafter)
    options: dict = field(default_factory=dict)  # kind config fields, e.g. num_heads
    init: str | None = None  # warm start: a checkpoint of the same kind (checkpoint.warm_start)
    resume: bool = False  # go on with the run saved beside `out` (checkpoint.py)
    checkpoint_minutes: float = 10.0  # save the drafter and the run this often
    loss_rows: str = "all"  # draft-step kinds: "answer" scores only the answer's rows (SpecForge's loss mask)
    step_decay: float = 1.0  # draft-step kinds: step s's loss weighs step_decay**(s-1) (SpecForge: 0.8)
    label_temperature: float = 1.0  # the soft labels sharpened to p^(1/T) (objectives.sharpen); 1: as distilled


def weigh_steps(objective, settings: TrainSettings) -> None:
    """Give a draft-step objective the rows and step weights its loss takes; refuse them for another. Also
    checks the label temperature, which every kind takes (Batch applies it)."""
    from specrt.export.training.objectives import FeatureObjective

    if settings.loss_rows not in ("all", "answer"):
        raise SpecrtError(f"--loss-rows {settings.loss_rows!r}: choose all or answer")
    if not 0 < settings.step_decay <= 1:
        raise SpecrtError(f"--step-decay {settings.step_decay}: choose a weight in (0, 1]")
    if not 0 < settings.label_temperature <= 1:
        raise SpecrtError(f"--label-temperature {settings.label_temperature}: choose a temperature in (0, 1] "
                          "(1: the labels as distilled)")
    if (settings.loss_rows, settings.step_decay) == ("all", 1.0):
        return
    if not isinstance(objective, FeatureObjective):
        raise SpecrtError(f"--loss-rows and --step-decay weigh the draft steps of eagle, eagle3 and mtp; {settings.kind} "
                          "trains otherwise: drop them")
    objective.answer_only = settings.loss_rows == "answer"
    objective.step_decay = settings.step_decay


def label_vocabulary(top1: torch.Tensor, anywhere: torch.Tensor, size: int) -> torch.Tensor:
    """Target ids the drafter is scored over in training: the `size` most frequent target top-1
    tokens (then the most frequent in the top-k lists). EAGLE-3 and block keep it as their draft
    vocabulary (their own head), EAGLE, MTP and Medusa as their head's (`Training.head_vocab`); for the
    others it only bounds the training LM-head cost."""
    counts = top1 + 1e-3 * anywhere
    return counts.topk(min(size, int((counts > 0).sum()))).indices.sort().values


def coverage_by_size(top1: torch.Tensor, sizes=(1024, 2048, 4096, 8192, 16384, 32768)) -> dict[str, float]:
    """The share of the target's top-1 choices the N most frequent ones cover, per N: what a draft
    vocabulary of N tokens can propose at most."""
    ranked = top1.sort(descending=True).values.cumsum(0) / top1.sum().clamp(min=1)
    return {str(n): round(float(ranked[min(n, len(ranked)) - 1]), 4) for n in sizes}


def lr_scale(step: int, total: int, seconds: float, limit_seconds: float, warmup: int = 50) -> float:
    """The learning rate's share of its peak: a linear warm-up over `warmup` steps, then a cosine down
    to 0.1 that ends at the step count or the time limit, whichever comes first (a run the limit cuts
    still finishes at its low rate). A resumed run counts the seconds of the runs before it on both
    sides, so a run cut by time restarts warm (part-way down the cosine), not at its peak."""
    progress = min(1.0, max(step / total, seconds / limit_seconds))
    return min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(objective, data: DistillData, seqs: list[int], label_index, batch_seqs: int,
             precision: str = "fp32") -> tuple[list[float], list[float]]:
    """Held-out top-1 agreement per draft step, and at the first step the share of rows whose target token
    is among the drafter's k best, k = 1..TOP_K (empty where the objective does not count it)."""
    totals: list[list[int]] = []
    within: list[int] = []
    for i in range(0, len(seqs), batch_seqs):
        with autocast(precision):
            _, hits = objective(Batch(data, seqs[i : i + batch_seqs], label_index))
        totals = [[a + h[0], b + h[1]] for (a, b), h in zip(totals or [[0, 0]] * len(hits), hits, strict=True)]
        if len(hits[0]) > 2:
            within = [a + b for a, b in zip(within or [0] * len(hits[0][2]), hits[0][2], strict=True)]
    first_rows = max(totals[0][1], 1) if totals else 1
    return [h / max(n, 1) for h, n in totals], [w / first_rows for w in within]


def data_taps(settings: TrainSettings, num_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs the distillation data records (EAGLE-3's taps)."""
    return tuple(settings.options.get("taps") or default_taps(num_layers))


def train_from_prompts(loaded: LoadedModel, settings: TrainSettings, out: Path, cache_dir: Path | None,
                       prompts: list[dict], progress: bool = True) -> dict:
    """Build (or reuse) the distillation data for `prompts`, then train."""
    taps = data_taps(settings, loaded.module.cfg.num_layers)
    data = build_data(loaded, prompts, settings.max_new_tokens, taps, cache_dir, progress)
    return train(loaded.module, settings, out, data, progress)


def train(target, settings: TrainSettings, out: Path, data: DistillData, progress: bool = True,
          clock=time.perf_counter) -> dict:
    """Train a `settings.kind` drafter for the `DecoderLM` target on `data`; save it to `out` (and, beside
    it, the run's state: checkpoint.py). `clock` times the limit, the schedule, evaluations and saves."""
    kind = settings.kind
    if settings.epochs == 0 and not settings.init:
        raise SpecrtError("--epochs 0 saves a warm start over this data's draft vocabulary: pass --init CHECKPOINT")
    spec = drafters.kind_spec(kind).training
    precision, precision_record = train_precision(settings.precision)  # before any work: a bad value fails fast
    torch.manual_seed(settings.seed)
    top1, anywhere = data.top_counts(target.cfg.vocab_size)
    vocab = label_vocabulary(top1, anywhere, settings.draft_vocab)
    options = dict(settings.options)
    if settings.init:
        options = checkpoint.inherited_options(Path(settings.init), kind, options)
    if spec.options_from_data:  # settings the data decides (EAGLE-3: its taps and draft vocabulary)
        options = resolve(spec.options_from_data)(options, data, vocab)
    label_index = torch.full((target.cfg.vocab_size,), -1, dtype=torch.long)
    label_index[vocab] = torch.arange(len(vocab))

    module = drafters.build(drafters.make_config(kind, **options), target)
    if spec.warm_start:
        resolve(spec.warm_start)(module, target, vocab)
    if settings.init:
        checkpoint.warm_start(module, Path(settings.init))
    if spec.head_vocab and len(vocab) < target.cfg.vocab_size:  # the head it is trained over is the one exported
        module.set_head_vocab(vocab)
    module.train()
    objective = resolve(spec.objective)(module, data, vocab, settings.steps)
    weigh_steps(objective, settings)
    params = [p for p in module.parameters() if p.requires_grad]
    lr = settings.lr or spec.lr
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

    train_seqs = [i for i in range(len(data)) if not data.heldout[i]]
    held = [i for i in range(len(data)) if data.heldout[i]]
    if not train_seqs or not held:
        raise SpecrtError("the prompt corpus needs both train and held-out prompts")
    per_epoch = math.ceil(len(train_seqs) / settings.batch_seqs)
    total = 0 if settings.epochs == 0 else max(1, int(settings.epochs * per_epoch))  # 0: --init re-saved
    eval_at = {round(total * (k + 1) / settings.evals) for k in range(settings.evals)}
    rng = torch.Generator().manual_seed(settings.seed)
    fixed = asdict(settings)
    if settings.resume:
        run = checkpoint.load_run(out, module, opt, rng, fixed)
        if run.data_sequences != len(data):  # the store grew: a fresh order over all of it
            run.order = []
    elif checkpoint.saved_run(out) is not None:
        raise SpecrtError(f"{checkpoint.state_dir(out)} holds a stopped run of {out}: add --resume to go on with "
                          "it, or remove that folder to start again")
    else:
        run = checkpoint.RunState()
    run.data_sequences = len(data)
    t0, cut, interrupted = clock() - run.seconds, False, False
    limit = settings.max_minutes * 60 + run.seconds
    eval_every = settings.max_minutes * 60 / settings.evals  # also by time: a run the limit cuts keeps a curve
    last_eval = last_save = clock()
    bar = tqdm(total=total, initial=min(run.step, total), desc=f"train {kind}", unit="step", disable=not progress)
    loss = torch.tensor(float("nan"))

    def save(stopped: bool = False) -> None:
        run.seconds = clock() - t0
        _write(module, settings, out, lr, precision, precision_record, run, cut, data, train_seqs, held, vocab, top1,
               stopped)
        checkpoint.save_run(out, module, opt, rng, run, fixed)

    try:
        while run.step < total:
            if not run.order:
                run.order = [train_seqs[i] for i in torch.randperm(len(train_seqs), generator=rng).tolist()]
            seqs = run.order[: settings.batch_seqs]
            t_step = clock()
            batch = Batch(data, seqs, label_index, settings.label_temperature)
            scale = lr_scale(run.step, total, clock() - t0, limit)
            for group in opt.param_groups:
                group["lr"] = lr * scale
            with autocast(precision):
                loss, _ = objective(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            # the step is done: only now is it counted (a stop before this point redoes the step on --resume)
            run.step, run.seen, run.order = run.step + 1, run.seen + int(batch.length.sum()), run.order[len(seqs):]
            bar.update()
            bar.set_postfix(loss=f"{loss.item():.3f}")
            run.train_seconds += clock() - t_step
            cut = clock() - t0 > limit
            if run.step in eval_at or cut or run.step == total or clock() - last_eval > eval_every:
                module.eval()
                accs = evaluate(objective, data, held, label_index, settings.batch_seqs, precision)
                module.train()
                point = _point(run, per_epoch, len(train_seqs), clock() - t0, loss, *accs)
                run.curve.append(point)
                last_eval = clock()
                bar.set_postfix(loss=f"{loss.item():.3f}", tau_est=point["tau_est"])
                if cut:
                    break
            if run.step < total and clock() - last_save > 60 * settings.checkpoint_minutes:  # (the end saves)
                module.eval()
                save()
                module.train()
                last_save = clock()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (the CLI turns it into this): keep what was trained
        interrupted = True
    bar.close()
    module.eval()
    if not interrupted and (not run.curve or run.curve[-1]["step"] != run.step):  # the head as saved
        accs = evaluate(objective, data, held, label_index, settings.batch_seqs, precision)
        run.curve.append(_point(run, per_epoch, len(train_seqs), clock() - t0, loss, *accs))
    save(stopped=interrupted)
    return json.loads((out / "metrics.json").read_text())


def _point(run: checkpoint.RunState, per_epoch: int, train_seqs: int, seconds: float, loss: torch.Tensor,
           accs: list[float], first_top_k: list[float]) -> dict:
    """One point of the curve: held-out top-1 per draft step against steps, tokens and sequences seen (and
    the first step's top-k agreement, where the objective counts it)."""
    return {"step": run.step, "epochs": round(run.step / per_epoch, 3), "tokens_seen": run.seen,
            "train_sequences": train_seqs, "seconds": round(seconds, 1),
            "train_tokens_per_second": round(run.seen / max(run.train_seconds, 1e-9), 1),
            "loss": round(loss.item(), 4) if run.step else None, "top1_per_step": [round(a, 4) for a in accs],
            "tau_est": round(chain_tau(accs), 3),
            **({"first_step_top_k": [round(a, 4) for a in first_top_k]} if first_top_k else {})}


# what metrics.json keeps of a warm start's run (not its own warm start: the record stays one level deep)
INIT_RUN_KEYS = ("settings", "steps_done", "train_sequences", "train_tokens", "label_vocab", "curve", "final")


def _write(module, settings: TrainSettings, out: Path, lr: float, precision: str, precision_record: dict,
           run: checkpoint.RunState, cut: bool, data: DistillData, train_seqs: list[int], held: list[int],
           vocab: torch.Tensor, top1: torch.Tensor, stopped: bool = False) -> None:
    """The drafter checkpoint at `out` with its metrics.json and τ curve, as the run stands (`stopped`: a stop
    cut its schedule, so metrics.json says `interrupted` and --resume goes on; scripts/train_round.sh reads it)."""
    drafters.save(module, out, settings.save_dtype)
    metrics = {"kind": settings.kind, "settings": asdict(settings), "lr": lr,
               "precision": METRICS_NAME[precision], "steps_done": run.step, "cut_by_max_minutes": cut,
               "branches": {"train_precision": precision_record, "aten_dispatch": aten_dispatch()},
               "train_sequences": len(train_seqs), "heldout_sequences": len(held),
               "train_tokens": int(sum(data.seq(i).stop - data.seq(i).start for i in train_seqs)),
               "label_vocab": len(vocab), "label_vocab_top1_coverage": round(float(top1[vocab].sum() / top1.sum()), 4),
               "top1_coverage_by_vocab_size": coverage_by_size(top1),
               "curve": run.curve, "final": run.curve[-1] if run.curve else {}, **({"interrupted": True} if stopped else {})}
    if settings.init and (Path(settings.init) / "metrics.json").is_file():  # the warm start's own run, one level
        init = json.loads((Path(settings.init) / "metrics.json").read_text())
        metrics["init_run"] = {k: init[k] for k in INIT_RUN_KEYS if k in init}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if run.curve:
        plot_curves({settings.kind: metrics}, out / "tau_curve.png", f"specrt train {settings.kind}")
