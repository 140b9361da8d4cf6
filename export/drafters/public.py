"""Load drafter checkpoints in the layouts their public projects publish (nothing is unpickled).

Each learned kind with a public layout declares it in its own module (export/drafters/<kind>.py):
a `PublicLayout` (how to recognise the folder, where its weights are: its spec's `public_layout`)
and a loader (its spec's `public_loader`), written with the helpers here. The rules are tried in
the registry's listing order on a `Probe` of the folder; they are exclusive (no folder of one
layout has what another's rule looks for).

Weights come from safetensors (single or sharded) or from `.bin` / `.pt` files read with
`torch.load(weights_only=True)`. The target's embedding and LM head are attached from the target;
copies in the checkpoint (`embed_tokens`, `shared_head.head`) are ignored.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch

from specrt.errors import SpecrtError
from specrt.export.drafters import build, check_target, kind_spec, load_state
from specrt.export.modeling import DecoderLM
from specrt.export.safetensors_file import check_safetensors
from specrt.kinds import kinds, resolve

CONFIG = "config.json"
MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
FIX = "use the checkpoint published for this target model, or re-download it"


class Weights:
    """The tensors of one checkpoint: a single file or a sharded index, read key by key."""

    def __init__(self, path: Path):
        self.path = path
        self._loaded: dict[Path, dict[str, torch.Tensor]] = {}
        if path.name.endswith(".index.json"):
            try:
                weight_map = json.loads(path.read_text())["weight_map"]
                self.files = {k: path.parent / f for k, f in weight_map.items()}
            except (OSError, KeyError, TypeError, AttributeError, ValueError) as e:
                raise SpecrtError(f"{path} is not a valid shard index ({type(e).__name__}: {e}): "
                                  "re-download the checkpoint") from None
            for f in sorted(set(self.files.values())):
                if not f.is_file():
                    raise SpecrtError(f"{path} names shard {f.name}, which is missing: download every shard")
                if f.suffix == ".safetensors":
                    check_safetensors(f, "re-download the checkpoint")
        else:
            self.files = dict.fromkeys(self._keys_of(path), path)

    def keys(self) -> list[str]:
        return list(self.files)

    def _keys_of(self, file: Path) -> list[str]:
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            check_safetensors(file, "re-download the checkpoint")
            try:
                with safe_open(str(file), "pt") as f:
                    return list(f.keys())
            except Exception as e:  # safetensors raises its own error types for corrupt files
                raise SpecrtError(f"{file} is not a readable safetensors file ({e}): re-download it") from None
        return list(self._pickled(file))

    def _pickled(self, file: Path) -> dict[str, torch.Tensor]:
        if file not in self._loaded:
            try:
                state = torch.load(file, weights_only=True, map_location="cpu")
            except Exception as e:  # weights_only refuses anything but tensors and plain containers
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise SpecrtError(f"{file} cannot be read as plain tensors (torch.load weights_only: {first}); "
                                  "convert it to safetensors from a trusted environment") from None
            if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
                state = state["state_dict"]
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise SpecrtError(f"{file} does not hold a flat dict of tensors: save the state_dict() of the "
                                  "drafter, or convert it to safetensors")
            self._loaded[file] = state
        return self._loaded[file]

    def tensors(self, names) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self.files[n], []).append(n)
        for file, keys in by_file.items():
            if file.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(file), "pt") as f:
                    out.update({k: f.get_tensor(k) for k in keys})
            else:
                state = self._pickled(file)
                out.update({k: state[k] for k in keys})
        return out


def _config(folder: Path) -> dict | None:
    path = folder / CONFIG
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:
        raise SpecrtError(f"{path} is not valid JSON ({e}): re-download the checkpoint") from None
    return meta if isinstance(meta, dict) else None


def _first(folder: Path, names) -> Path | None:
    return next((folder / n for n in names if (folder / n).is_file()), None)


class Probe:
    """What a layout rule reads of a folder: its config.json (`meta`, {} without one), its files, and
    its weights (read once, whichever rule asks first)."""

    def __init__(self, folder: Path, meta: dict):
        self.folder, self.meta = folder, meta
        self._weights: dict[Path, Weights] = {}

    def first(self, names) -> Path | None:
        """The first of the files `names` the folder has."""
        return _first(self.folder, names)

    def weights(self, names=MODEL_FILES) -> Weights | None:
        """The tensors of the first of the files `names` the folder has (None: it has none)."""
        path = self.first(names)
        if path is None:
            return None
        if path not in self._weights:
            self._weights[path] = Weights(path)
        return self._weights[path]


@dataclass(frozen=True)
class PublicLayout:
    """A public checkpoint layout: `matches` recognises it; its weights are the first of `weight_files`."""

    describe: str  # for the error that lists every layout, e.g. "MTP (num_nextn_predict_layers)"
    matches: Callable[[Probe], bool]
    weight_files: tuple[str, ...] = MODEL_FILES
    wanted: tuple[str, ...] | None = None  # the files an error names when there are no weights (weight_files)


def _layouts() -> list[tuple[str, PublicLayout]]:
    return [(s.name, resolve(s.public_layout)) for s in kinds().values() if s.public_layout]


def layouts_described() -> str:
    """Every public layout, for messages."""
    return ", ".join(layout.describe for _, layout in _layouts())


def _inspect(folder: Path) -> tuple[str | None, dict, Weights | None]:
    """(layout, config.json, weights) of a folder; layout None when it is none of the public ones."""
    folder = Path(folder)
    meta = _config(folder)
    if meta is not None and "kind" in meta:
        return None, meta, None  # a specrt checkpoint
    probe = Probe(folder, meta or {})
    for kind, layout in _layouts():
        if layout.matches(probe):
            return kind, probe.meta, probe.weights(layout.weight_files)
    return None, probe.meta, None


def detect(folder: Path) -> str | None:
    """Which public layout `folder` holds (the kind whose rule matches, e.g. "medusa"), or None."""
    return _inspect(Path(folder))[0]


def is_public(folder: Path) -> bool:
    """Whether `drafters.load` should hand `folder` to `load_public`: its config.json has no "kind",
    or it has no config.json but holds a public layout."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / CONFIG).read_text())
    except (OSError, ValueError):
        meta = None
    if isinstance(meta, dict):
        return "kind" not in meta
    return not (folder / CONFIG).is_file() and detect(folder) is not None


def load_public(folder: Path, target: DecoderLM):
    """A drafter module for `target` (eval mode) with the weights of a public checkpoint folder."""
    folder = Path(folder)
    layout, meta, weights = _inspect(folder)
    if layout is None:
        raise SpecrtError(f"{folder} holds neither a specrt drafter checkpoint (config.json with \"kind\") nor a "
                          f"public {layouts_described()} checkpoint: pass a drafter folder")
    if weights is None:
        rule = resolve(kind_spec(layout).public_layout)
        wanted = rule.wanted or rule.weight_files
        raise SpecrtError(f"{folder} has a {layout} config.json but no weights ({' / '.join(wanted)}): "
                          "download the weight files too")
    module = resolve(kind_spec(layout).public_loader)(folder, meta, weights, target)
    return module.eval()


# ---------------------------------------------------------------------------------------------- helpers


def build_for(cfg, target: DecoderLM, dec=None):
    """`drafters.build`, with the drafter layer's own settings (`dec`) where they differ from the target's."""
    return build(cfg, target, None if dec is None or dec == target.cfg else dec)


def layer_dec(target: DecoderLM, meta: dict, keys, prefix: str, source: Path):
    """The target's decoder settings with the drafter layer's bias / norm flags (read from its keys),
    norm epsilon and MLP width (from config.json). Heads must match the target's."""
    t = target.cfg
    heads = meta.get("num_attention_heads")
    checks = [("num_attention_heads", heads, t.num_heads),
              ("num_key_value_heads", meta.get("num_key_value_heads", heads), t.num_kv_heads),
              ("head_dim", meta.get("head_dim") or (heads and meta.get("hidden_size", t.hidden_size) // heads),
               t.head_dim)]
    for name, theirs, ours in checks:
        if theirs is not None and int(theirs) != ours:
            raise SpecrtError(f"{source}: the drafter layer has {name} {theirs}, the target has {ours}: {FIX}")
    keys = set(keys)
    return replace(t, qkv_bias=f"{prefix}self_attn.q_proj.bias" in keys, o_bias=f"{prefix}self_attn.o_proj.bias" in keys,
                   mlp_bias=f"{prefix}mlp.gate_proj.bias" in keys, qk_norm=f"{prefix}self_attn.q_norm.weight" in keys,
                   rms_norm_eps=float(meta.get("rms_norm_eps", t.rms_norm_eps)),
                   intermediate_size=int(meta.get("intermediate_size") or t.intermediate_size))


def check_dims(meta: dict, target: DecoderLM, source: Path) -> None:
    if "hidden_size" in meta and "vocab_size" in meta:
        check_target(SimpleNamespace(hidden_size=meta["hidden_size"], vocab_size=meta["vocab_size"]), target.cfg, source)


def fill(module, weights: Weights, keys, to_public: Callable[[str], str], what: str, defaults=None) -> None:
    """Load `keys` of `weights` (public names) into `module`, whose keys map to public names by `to_public`;
    `defaults` (our names) stand in for keys the checkpoint may omit."""
    src, defaults = weights.path, defaults or {}
    own = module.trainable_state()
    our_of = {to_public(k): k for k in own}
    present = set(keys)
    missing = sorted(p for p, o in our_of.items() if p not in present and o not in defaults)
    unexpected = sorted(k for k in keys if k not in our_of)
    if missing or unexpected:
        raise SpecrtError(f"{src} does not match a {what} checkpoint for this target: missing {_few(missing)}, "
                          f"unexpected {_few(unexpected)}: {FIX}")
    state = weights.tensors(keys)
    for p, v in state.items():
        need = tuple(own[our_of[p]].shape)
        if tuple(v.shape) != need:
            raise SpecrtError(f"{src}: {p} has shape {tuple(v.shape)}, this target needs {need}: {FIX}")
    ours = {our_of[p]: v for p, v in state.items()}
    load_state(module, {**{k: v for k, v in defaults.items() if k not in ours}, **ours}, src)


def _few(names: list[str]) -> str:
    return str(names[:4])[:-1] + (", …]" if len(names) > 4 else "]")


def ignored(key: str) -> bool:
    return key.endswith("rotary_emb.inv_freq")
