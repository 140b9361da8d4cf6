"""Where a training run starts from: a warm start from another checkpoint of the same kind (`--init`), or
the saved state of a stopped run (`--resume`).

A run's state lives in `OUT.train-state/` beside the checkpoint folder OUT (whose writes replace OUT whole)
and is replaced whole (a temporary folder, then renamed) every
`checkpoint_minutes`, at the end, and when the run is stopped (Ctrl-C, SIGTERM, the time limit):

    state.safetensors   the drafter's weights (fp32), AdamW's moments and step counts, the data-order RNG
    state.json          step, tokens seen, seconds trained, the curve so far, the settings that must not
                        change on resume, AdamW's param groups, and the rest of this epoch's order

Nothing is unpickled: tensors are safetensors, everything else JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specrt.errors import SpecrtError, changes

STATE_SUFFIX = ".train-state"
TENSORS, META = "state.safetensors", "state.json"
VOCAB_KEYS = ("d2t", "head_vocab")  # the draft vocabulary: the new data's, never the warm start's
# settings a resumed run must share with the run it continues (others, such as --max-minutes, may change)
FIXED = ("kind", "batch_seqs", "lr", "steps", "seed", "draft_vocab", "options", "precision", "loss_rows", "step_decay",
         "label_temperature")
# what a run saved before these settings existed used
FIXED_DEFAULTS = {"loss_rows": "all", "step_decay": 1.0, "label_temperature": 1.0}
# config fields that shape the weights a warm start copies: a run takes the checkpoint's unless --set names them
INHERITED = ("head_from_target",)
HEAD_ROWS = "lm_head.weight"  # a stored head: one row per draft-vocabulary id (d2t)


@dataclass
class RunState:
    step: int = 0
    seen: int = 0
    train_seconds: float = 0.0
    seconds: float = 0.0  # wall time of the runs before this one
    curve: list = field(default_factory=list)
    order: list = field(default_factory=list)  # sequence indices left in this epoch
    data_sequences: int = 0  # the data's size when saved: a grown store redraws the order


def inherited_options(folder: Path, kind: str, options: dict) -> dict:
    """`options` with the `--init` checkpoint's INHERITED config fields where `options` does not name them: a
    head trained with its own rows warm-starts a run that trains its own rows too, without the flag again."""
    from specrt.export.drafters import read_config

    cfg, _ = read_config(folder)
    if cfg.kind != kind:
        return dict(options)  # warm_start says why it does not fit
    return {**{k: getattr(cfg, k) for k in INHERITED if hasattr(cfg, k)}, **options}


def warm_start(module, folder: Path) -> int:
    """Copy every trainable weight of the checkpoint at `folder` (same kind and shapes) into `module`,
    except its draft vocabulary (the data decides that). Returns the number of tensors copied.

    A checkpoint whose head is the target's rows (`head_from_target`: not stored) starts a module that trains
    its own head (`--set head_from_target=false`) with every other weight; the head keeps the target's rows the
    kind's warm start gave it, which is the head that checkpoint ran with. A stored head is re-indexed to
    the module's draft vocabulary (`head_rows_in_vocab`)."""
    from safetensors.torch import load_file

    from specrt.export.drafters import WEIGHTS, read_config
    from specrt.export.safetensors_file import check_safetensors

    cfg, _ = read_config(folder)
    if cfg.kind != module.cfg.kind:
        raise SpecrtError(f"--init {folder} is a {cfg.kind} checkpoint; this run trains {module.cfg.kind}: "
                          "pass a checkpoint of the same kind")
    weights = Path(folder) / WEIGHTS
    check_safetensors(weights, "train or copy the checkpoint again")
    stored = load_file(weights)
    state = {k: v for k, v in stored.items() if k not in VOCAB_KEYS}
    own = {k: v for k, v in module.trainable_state().items() if k not in VOCAB_KEYS}
    if HEAD_ROWS in state and HEAD_ROWS in own and "d2t" in stored and hasattr(module, "target_ids"):
        state[HEAD_ROWS] = head_rows_in_vocab(state[HEAD_ROWS], stored["d2t"], module)
    inherited = {HEAD_ROWS} if getattr(cfg, "head_from_target", False) else set()  # from the target
    wrong = [k for k in own if (k not in state and k not in inherited) or
             (k in state and tuple(state[k].shape) != tuple(own[k].shape))]
    if wrong or set(state) - set(own):
        raise SpecrtError(f"--init {folder} does not fit this {module.cfg.kind} drafter (differs at "
                          f"{(wrong or sorted(set(state) - set(own)))[:4]}): pass one trained with the same options")
    module.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=False)
    return len(state)


def head_rows_in_vocab(rows: torch.Tensor, d2t: torch.Tensor, module) -> torch.Tensor:
    """A stored head's rows, over the checkpoint's draft vocabulary (target id = draft id + d2t), re-indexed to
    `module`'s: a target id both vocabularies hold keeps the checkpoint's row, one new to the data keeps the row
    `module` has (the target's, from the kind's warm start). A grown store reorders or changes the vocabulary,
    and copying rows by position would give each draft id another token's row."""
    head = module.lm_head.weight.detach()
    if rows.dim() != 2 or rows.shape[0] != len(d2t) or rows.shape[1] != head.shape[1]:
        return rows  # warm_start's shape check names it
    old = torch.arange(len(d2t)) + d2t.long()
    new = module.target_ids().long()
    where = torch.full((int(max(old.max(), new.max())) + 1,), -1, dtype=torch.long)
    where[old] = torch.arange(len(old))
    src = where[new]
    out = head.clone().to(rows.dtype)
    out[src >= 0] = rows[src[src >= 0]]
    return out


def state_dir(out: Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + STATE_SUFFIX)


def save_run(out: Path, module, opt: torch.optim.Optimizer, rng: torch.Generator, run: RunState,
             settings: dict) -> None:
    """Replace `out`'s saved run with the run as it stands."""
    from safetensors.torch import save_file

    from specrt.export.bundle import atomic_dir

    tensors = {f"model/{k}": v.detach().float().contiguous() if v.is_floating_point() else v.contiguous()
               for k, v in module.trainable_state().items()}
    opt_state = opt.state_dict()
    for i, slots in opt_state["state"].items():
        for name, value in slots.items():
            tensors[f"opt/{i}/{name}"] = torch.as_tensor(value).contiguous()
    tensors["rng"] = rng.get_state()
    meta = {"run": run.__dict__, "settings": {k: settings[k] for k in FIXED},
            "param_groups": opt_state["param_groups"]}
    with atomic_dir(state_dir(out)) as tmp:
        save_file(tensors, tmp / TENSORS)
        (tmp / META).write_text(json.dumps(meta))


def saved_run(out: Path) -> Path | None:
    folder = state_dir(out)
    return folder if (folder / META).is_file() else None


def load_run(out: Path, module, opt: torch.optim.Optimizer, rng: torch.Generator, settings: dict) -> RunState:
    """Restore the run saved beside `out` into `module`, `opt` and `rng`; its fixed settings must
    equal `settings`'."""
    from safetensors.torch import load_file

    from specrt.export.safetensors_file import check_safetensors

    folder = saved_run(out)
    if folder is None:
        raise SpecrtError(f"--resume: {state_dir(out)} holds no saved run; drop --resume to start one")
    try:
        meta = json.loads((folder / META).read_text())
        run = RunState(**meta["run"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise SpecrtError(f"{folder / META} is damaged ({type(e).__name__}): remove {folder} and start again") from None
    if said := changes({**FIXED_DEFAULTS, **meta["settings"]}, settings, FIXED):
        raise SpecrtError(f"--resume: the run in {folder} was started with other settings ({said}): use the "
                          "same ones, or train into another -o folder")
    check_safetensors(folder / TENSORS, f"remove {folder} and start again")
    tensors = load_file(folder / TENSORS)
    own = module.trainable_state()
    model = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
    if set(model) != set(own) or any(tuple(v.shape) != tuple(own[k].shape) for k, v in model.items()):
        raise SpecrtError(f"{folder} holds a drafter of other shapes: remove it, or train into another -o folder")
    module.load_state_dict({k: v.to(own[k].dtype) for k, v in model.items()}, strict=False)
    slots: dict[int, dict] = {}
    for k, v in tensors.items():
        if k.startswith("opt/"):
            _, i, name = k.split("/", 2)
            slots.setdefault(int(i), {})[name] = v
    opt.load_state_dict({"state": slots, "param_groups": meta["param_groups"]})
    rng.set_state(tensors["rng"])
    return run
