"""Load drafter checkpoints in the layouts their public projects publish (nothing is unpickled).

    medusa   FasterDecoding/Medusa: config.json (medusa_num_heads, medusa_num_layers) and
             medusa_lm_head.safetensors / .pt with `{k}.{j}.linear.*` and own heads `{k}.{L}.weight`
             (or a full Medusa-2 model whose weights hold `medusa_head.*`)
    eagle    SafeAILab/EAGLE-1/2: Llama-style config.json; `fc.*` and `layers.0.*` (EAGLE-1 drops the
             layer's input_layernorm)
    eagle3   EAGLE-3: `fc` [H, n·H], `midlayer.*`, `norm`, `lm_head` [draft vocab, H], `d2t`
             (`t2d` is derived and ignored); taps from eagle_config.eagle_aux_hidden_state_layer_ids
    mtp      DeepSeek-V3-style: a model folder whose layers L .. L+n-1 (L = num_hidden_layers,
             n = num_nextn_predict_layers) are MTP modules; dense Llama-style blocks only

Weights come from safetensors (single or sharded) or from `.bin` / `.pt` files read with
`torch.load(weights_only=True)`. The target's embedding and LM head are attached from the target;
copies in the checkpoint (`embed_tokens`, `shared_head.head`) are ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from specrt.errors import SpecrtError
from specrt.export.drafters import build, check_target, kind_spec, load_state, make_config
from specrt.export.drafters.eagle import default_taps
from specrt.export.modeling import DecoderLM
from specrt.export.safetensors_file import check_safetensors
from specrt.kinds import resolve

CONFIG = "config.json"
MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "medusa_lm_head.bin")
LAYOUTS = "Medusa (medusa_lm_head.*), EAGLE / EAGLE-3 (fc + layers.0 / midlayer) or MTP (num_nextn_predict_layers)"
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


def _inspect(folder: Path) -> tuple[str | None, dict, Weights | None]:
    """(layout, config.json, weights) of a folder; layout None when it is none of the public ones."""
    folder = Path(folder)
    meta = _config(folder)
    if meta is not None and "kind" in meta:
        return None, meta, None  # a specrt checkpoint
    meta = meta or {}
    medusa_file = _first(folder, MEDUSA_FILES)
    if "medusa_num_heads" in meta or medusa_file is not None:
        path = medusa_file or _first(folder, MODEL_FILES)
        return "medusa", meta, Weights(path) if path else None
    path = _first(folder, MODEL_FILES)
    if (meta.get("num_nextn_predict_layers") or 0) > 0:
        return "mtp", meta, Weights(path) if path else None
    if path is None:
        return None, meta, None
    weights = Weights(path)
    keys = weights.keys()
    if any(k.startswith("midlayer.") for k in keys):
        return "eagle3", meta, weights
    if "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys):
        return "eagle", meta, weights
    return None, meta, None


def detect(folder: Path) -> str | None:
    """Which public layout `folder` holds: "medusa", "eagle", "eagle3", "mtp", or None."""
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
                          f"public {LAYOUTS} checkpoint: pass a drafter folder")
    if weights is None:
        wanted = MEDUSA_FILES if layout == "medusa" else MODEL_FILES
        raise SpecrtError(f"{folder} has a {layout} config.json but no weights ({' / '.join(wanted)}): "
                          "download the weight files too")
    module = resolve(kind_spec(layout).public_loader)(folder, meta, weights, target)
    return module.eval()


# ---------------------------------------------------------------------------------------------- helpers


def _build(cfg, target: DecoderLM, dec=None):
    """`drafters.build`, with the drafter layer's own settings (`dec`) where they differ from the target's."""
    return build(cfg, target, None if dec is None or dec == target.cfg else dec)


def _layer_dec(target: DecoderLM, meta: dict, keys, prefix: str, source: Path):
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


def _check_dims(meta: dict, target: DecoderLM, source: Path) -> None:
    if "hidden_size" in meta and "vocab_size" in meta:
        check_target(SimpleNamespace(hidden_size=meta["hidden_size"], vocab_size=meta["vocab_size"]), target.cfg, source)


def _fill(module, weights: Weights, keys, to_public: Callable[[str], str], what: str, defaults=None) -> None:
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


def _ignored(key: str) -> bool:
    return key.endswith("rotary_emb.inv_freq")


# ---------------------------------------------------------------------------------------------- layouts


def load_medusa(folder: Path, meta: dict, weights: Weights, target: DecoderLM):
    src = weights.path
    keys = [k for k in weights.keys() if not _ignored(k)]
    full_model = not src.name.startswith("medusa_lm_head")
    prefix = "medusa_head." if full_model or any(k.startswith("medusa_head.") for k in keys) else ""
    if full_model:
        keys = [k for k in keys if k.startswith(prefix)]
    parsed = [re.match(r"(\d+)\.(\d+)\.", k[len(prefix):]) for k in keys]
    if not keys or not all(parsed):
        bad = [k for k, m in zip(keys, parsed, strict=True) if not m][:4]
        raise SpecrtError(f"{src} holds no Medusa heads ({{k}}.{{j}}.linear.weight) {bad or ''}: pass the folder "
                          "with medusa_lm_head.safetensors / .pt")
    num_heads = int(meta.get("medusa_num_heads") or 1 + max(int(m[1]) for m in parsed))
    num_layers = meta.get("medusa_num_layers")
    if num_layers is None:
        num_layers = sum(1 for k in keys if re.fullmatch(r"0\.\d+\.linear\.weight", k[len(prefix):]))
    num_layers = int(num_layers)
    own_heads = any(k[len(prefix):] == f"{h}.{num_layers}.weight" for k in keys for h in range(num_heads))
    module = _build(make_config("medusa", num_heads=num_heads, num_layers=num_layers, own_heads=own_heads), target)
    _fill(module, weights, keys, lambda k: prefix + k.removeprefix("medusa_head."),
          f"Medusa ({num_heads} heads × {num_layers} layers, from {folder / CONFIG})")
    return module


def load_eagle(folder: Path, meta: dict, weights: Weights, target: DecoderLM):
    _check_dims(meta, target, folder / CONFIG)
    keys = [k for k in weights.keys() if not _ignored(k) and k != "embed_tokens.weight"]
    fc_bias = "fc.bias" in keys or meta.get("bias") is True
    cfg = make_config("eagle", fc_bias=fc_bias, input_norm="layers.0.input_layernorm.weight" in keys)
    module = _build(cfg, target, _layer_dec(target, meta, keys, "layers.0.", folder / CONFIG))
    _fill(module, weights, keys, lambda k: k, "one-layer EAGLE")
    return module


def load_eagle3(folder: Path, meta: dict, weights: Weights, target: DecoderLM):
    src = weights.path
    _check_dims(meta, target, folder / CONFIG)
    keys = [k for k in weights.keys() if not _ignored(k) and k not in ("embed_tokens.weight", "t2d")]
    head = weights.tensors(["lm_head.weight"])["lm_head.weight"] if "lm_head.weight" in keys else None
    draft_vocab = int(meta.get("draft_vocab_size") or (head.shape[0] if head is not None else target.cfg.vocab_size))
    taps = (meta.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    taps = [int(t) for t in taps] if taps else default_taps(target.cfg.num_layers)
    bad = [t for t in taps if not 0 <= t < target.cfg.num_layers]
    if bad:
        raise SpecrtError(f"{folder / CONFIG}: eagle_aux_hidden_state_layer_ids {taps} name layers the target lacks "
                          f"(it has {target.cfg.num_layers}): {FIX}")
    fc = weights.tensors(["fc.weight"])["fc.weight"] if "fc.weight" in keys else None
    if fc is not None and fc.shape[-1] != len(taps) * target.cfg.hidden_size:
        raise SpecrtError(f"{src}: fc.weight has shape {tuple(fc.shape)}, which fuses "
                          f"{fc.shape[-1] / target.cfg.hidden_size:g} target layers, but the taps are {taps}: "
                          "set eagle_config.eagle_aux_hidden_state_layer_ids in config.json, or " + FIX)
    cfg = make_config("eagle3", taps=taps, draft_vocab_size=draft_vocab)
    module = _build(cfg, target, _layer_dec(target, meta, keys, "midlayer.", folder / CONFIG))
    # without d2t the draft vocabulary must be the target's (the identity map)
    defaults = {"d2t": torch.zeros(draft_vocab, dtype=torch.int64)} if draft_vocab == target.cfg.vocab_size else {}
    _fill(module, weights, keys, lambda k: k, "EAGLE-3", defaults)
    ids = module.target_ids()
    if int(ids.min()) < 0 or int(ids.max()) >= target.cfg.vocab_size:
        raise SpecrtError(f"{src}: d2t maps draft ids to target ids outside 0..{target.cfg.vocab_size - 1}: {FIX}")
    return module


def load_mtp(folder: Path, meta: dict, weights: Weights, target: DecoderLM):
    src = weights.path
    _check_dims(meta, target, folder / CONFIG)
    n, layers = int(meta["num_nextn_predict_layers"]), int(meta.get("num_hidden_layers", target.cfg.num_layers))
    if layers != target.cfg.num_layers:
        raise SpecrtError(f"{folder / CONFIG}: the MTP modules follow a {layers}-layer model, the target has "
                          f"{target.cfg.num_layers} layers: {FIX}")
    pattern = re.compile(r"model\.layers\.(\d+)\.")
    keys = []
    for k in weights.keys():
        m = pattern.match(k)
        if m and int(m[1]) >= layers and not _ignored(k) \
                and not k.endswith((".embed_tokens.weight", ".shared_head.head.weight")):
            keys.append(k)
    moe = [k for k in keys if re.search(r"\.mlp\.(experts|shared_experts|gate)\.", k)]
    if moe:
        raise SpecrtError(f"{src}: the MTP blocks use a mixture-of-experts MLP ({moe[0]}); only dense Llama-style "
                          "MLP blocks (gate_proj / up_proj / down_proj) are supported")
    mla = [k for k in keys if re.search(r"\.self_attn\.(q_a_proj|kv_a_proj)", k)]
    if mla:
        raise SpecrtError(f"{src}: the MTP blocks use multi-head latent attention ({mla[0]}); only Llama-style "
                          "attention (q_proj / k_proj / v_proj / o_proj) is supported")
    cfg = make_config("mtp", num_modules=n, num_steps=max(n, 3))
    module = _build(cfg, target, _layer_dec(target, {}, keys, f"model.layers.{layers}.", src))

    def to_public(k: str) -> str:
        _, idx, rest = k.split(".", 2)
        return f"model.layers.{layers + int(idx)}.{rest.removeprefix('block.')}"

    _fill(module, weights, keys, to_public, f"{n}-module MTP (layers {layers}..{layers + n - 1})")
    return module


