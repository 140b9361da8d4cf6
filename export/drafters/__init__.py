"""Learned drafters' checkpoints: config and weights I/O for every kind declared in specrt/kinds/.

A drafter checkpoint is a folder: `config.json` ({"kind", "decoder": target dims, kind fields})
and `model.safetensors` with the drafter's own weights. The target's embedding and LM head are
never stored: they are attached from the target when the checkpoint is loaded.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.export.modeling import DecoderLM
from specrt.export.safetensors_file import check_safetensors
from specrt.kinds import DrafterSpec, kind, learned_kinds, resolve
from specrt.schema.config import DecoderConfig

CONFIG, WEIGHTS = "config.json", "model.safetensors"


def kind_spec(name: str) -> DrafterSpec:
    """The spec of a learned kind (specrt/kinds/), or a clear error."""
    spec = kind(name)
    if not spec.learned:
        raise SpecrtError(f"drafter {name!r} has no weights to train or export: choose one of "
                          f"{', '.join(learned_kinds())}")
    return spec


def make_config(kind: str, **fields_) -> object:
    config_cls = resolve(kind_spec(kind).config)
    known = {f.name for f in fields(config_cls)}
    bad = sorted(set(fields_) - known)
    if bad:
        raise SpecrtError(f"{kind} drafter has no setting {', '.join(bad)}: known {', '.join(sorted(known - {'kind'}))}")
    return config_cls(**fields_)


def build(cfg, target: DecoderLM, dec: DecoderConfig | None = None):
    """A fresh drafter module for `target` with the target's shared weights attached; `dec`: the drafter
    layer's own settings where they differ from the target's (public checkpoints)."""
    spec = kind_spec(cfg.kind)
    module = resolve(spec.module)(cfg, target.cfg if dec is None else dec)
    head = target.lm_head.weight if spec.shares_lm_head(cfg) else None
    module.attach_target(target.model.embed_tokens.weight, head)
    if dec is None and hasattr(module, "init_from"):
        module.init_from(target)
    return module


SAVE_DTYPES = {"fp32": "float32", "fp16": "float16"}
HEAD_VOCAB = "head_vocab"  # checkpoint tensor: the draft vocabulary of a head over the target's (sorted ids)


def save(module, folder: Path, dtype: str = "fp32") -> None:
    """config.json + model.safetensors (floating weights as `dtype`: fp32 or fp16), written to a
    temporary folder then renamed. Loading converts them back to the module's fp32."""
    import torch
    from safetensors.torch import save_file

    from specrt.export.bundle import atomic_dir

    if dtype not in SAVE_DTYPES:
        raise SpecrtError(f"checkpoint dtype {dtype!r}: choose one of {', '.join(SAVE_DTYPES)}")
    want = getattr(torch, SAVE_DTYPES[dtype])
    with atomic_dir(Path(folder)) as tmp:
        state = {k: (v.to(want) if v.is_floating_point() else v).detach().contiguous()
                 for k, v in module.trainable_state().items()}
        if getattr(module, "head_vocab", None) is not None:
            state[HEAD_VOCAB] = module.head_vocab.contiguous()
        save_file(state, tmp / WEIGHTS, metadata={"format": "pt", "kind": module.cfg.kind})
        meta = {**asdict(module.cfg), "decoder": module.dec.to_dict()}  # the dims it was made for
        (tmp / CONFIG).write_text(json.dumps(meta, indent=2))


def read_config(folder: Path) -> tuple[object, DecoderConfig]:
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise SpecrtError(f"{path} is missing: {folder} is not a specrt drafter checkpoint "
                          "(train one with `specrt train KIND`, or pass a public Medusa/EAGLE/MTP checkpoint)")
    try:
        meta = json.loads(path.read_text())
        dec = DecoderConfig.from_dict(meta.pop("decoder"), "decoder")
        return make_config(meta.pop("kind"), **meta), dec
    except (KeyError, TypeError, ValueError) as e:
        raise SpecrtError(f"{path} is not a valid drafter config ({type(e).__name__}: {e})") from None


def load(folder: Path, target: DecoderLM):
    """Load a specrt drafter checkpoint for `target` (safetensors only; nothing is unpickled)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    from specrt.export.drafters import public  # local import: public imports this module

    if public.is_public(folder):  # config.json without "kind": a public Medusa / EAGLE / EAGLE-3 / MTP layout
        return public.load_public(folder, target)
    cfg, dec = read_config(folder)
    check_target(dec, target.cfg, folder)
    module = build(cfg, target)
    weights = folder / WEIGHTS
    if not weights.is_file():
        raise SpecrtError(f"{weights} is missing: the drafter checkpoint is incomplete; train or copy it again")
    check_safetensors(weights, "train or copy the checkpoint again")
    state = load_file(weights)
    vocab = state.pop(HEAD_VOCAB, None)
    load_state(module, state, weights)
    if vocab is not None:
        module.set_head_vocab(check_head_vocab(vocab, target.cfg.vocab_size, weights))
    if hasattr(module, "attach_head"):  # a head sliced from the target once the draft vocabulary is loaded
        module.attach_head(target)
    return module.eval()


def load_state(module, state: dict, source) -> None:
    own = module.trainable_state()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise SpecrtError(f"{source} does not match a {module.cfg.kind} drafter for this target: "
                          f"missing {missing[:4]}, unexpected {unexpected[:4]}")
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise SpecrtError(f"{source}: {k} has shape {tuple(v.shape)}, this target needs {tuple(own[k].shape)}")
    module.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=False)


def check_head_vocab(ids, vocab_size: int, source):
    """`ids` as a draft vocabulary of a `vocab_size` target: distinct target ids, ascending."""
    import torch

    ok = ids.dim() == 1 and len(ids) > 0 and not ids.is_floating_point()
    if ok:
        ok = bool((ids[1:] > ids[:-1]).all()) and 0 <= int(ids[0]) and int(ids[-1]) < vocab_size
    if not ok:
        raise SpecrtError(f"{source}: {HEAD_VOCAB} must list distinct target ids 0..{vocab_size - 1} in ascending "
                          "order: train or copy the checkpoint again")
    return ids.to(torch.long)


def check_target(dec: DecoderConfig, target: DecoderConfig, source) -> None:
    for name in ("hidden_size", "vocab_size"):
        if getattr(dec, name) != getattr(target, name):
            raise SpecrtError(f"drafter {source} was made for {name} {getattr(dec, name)}, the target has "
                              f"{getattr(target, name)}: use a drafter trained for this target")

