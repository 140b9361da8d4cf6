"""OpenVINO GenAI's own int4 models for the openvino peer: `python -m specrt.tools.openvino_models --hf HF`.

Run by the openvino venv's interpreter (`make setup-peer-openvino`), which has optimum-intel and nncf.
From the peers' shared fp32 HF folder (`peer_models.ensure_hf_folder`, made in specrt's own venv):

    HF ──optimum-cli export openvino --weight-format int4 ...──▶ tmp/out ──rename──▶ <model>-int4
    HF ──first N layers (config num_hidden_layers=N)──▶ tmp/hf ──the same export──▶ <model>-first<N>-int4

both under $SPECRT_HOME/peers/openvino. The second is the draft of OpenVINO's speculative decoding:
the same layer-truncated copy of the target that `specrt export` makes its default draft from. Each
folder's record is written last, inside the temporary folder: a folder with one is complete, and is
not converted again. Only the standard library is imported at module level (both venvs import this).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.paths import home

# optimum-cli's int4 options, passed explicitly and recorded beside each model. Chosen to match
# onnxruntime-genai's int4 build (peer_models.ORTGENAI_OPTIONS: symmetric blocks of 32, every MatMul
# int4, the LM head included): ratio 1.0 (no layer left int8), groups of 32, symmetric, and all_layers
# so NNCF does not keep the embedding / LM head in its int8 backup. Data-free (no calibration set).
OPENVINO_OPTIONS = {"task": "text-generation-with-past", "weight_format": "int4", "group_size": 32,
                    "ratio": 1.0, "sym": True, "all_layers": True}
DRAFT_LAYERS = 4  # specrt export's default draft (export/bundle.py DEFAULT_DRAFT_LAYERS): the first 4 layers
RECORD = "specrt_openvino_model.json"  # written last into the temporary folder: it marks a complete model
SETUP_COMMAND = "make setup-peer-openvino"
LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a decoder layer's weight: model.layers.<i>.*


def openvino_root() -> Path:
    return home() / "peers" / "openvino"


def target_dir(model: str) -> Path:
    """Where OpenVINO's int4 model of `model` (peer_models.model_name of the source) lives."""
    return openvino_root() / f"{model}-int4"


def draft_dir(model: str, layers: int) -> Path:
    """Where OpenVINO's int4 model of the target's first `layers` layers lives."""
    return openvino_root() / f"{model}-first{layers}-int4"


def is_converted(folder: Path) -> bool:
    return (folder / RECORD).is_file() and (folder / "openvino_model.xml").is_file()


def export_command(hf: Path, out: Path, options: dict = OPENVINO_OPTIONS, cli: str | None = None) -> list[str]:
    """optimum-intel's export command line for `options` (every option spelled out, none left to a
    per-model default config)."""
    cmd = [cli or str(Path(sys.executable).parent / "optimum-cli"), "export", "openvino", "--model", str(hf),
           "--task", options["task"], "--weight-format", options["weight_format"],
           "--group-size", str(options["group_size"]), "--ratio", str(options["ratio"])]
    cmd += ["--sym"] if options.get("sym") else []
    cmd += ["--all-layers"] if options.get("all_layers") else []
    return cmd + [str(out)]


def truncated_hf_folder(hf: Path, out: Path, layers: int) -> dict:
    """The HF folder `hf` cut to its first `layers` decoder layers (plus embedding, final norm, head),
    written to `out`: config num_hidden_layers=layers (transformers then builds only those), weights of
    the later layers left out. Returns the config written."""
    cfg = json.loads((hf / "config.json").read_text())
    total = int(cfg.get("num_hidden_layers") or 0)
    if not 1 <= layers < total:
        raise SpecrtError(f"a {layers}-layer draft of {hf} (num_hidden_layers {total}): choose 1 to {total - 1} "
                          "layers (OPENVINO_DRAFT_LAYERS / --draft-layers)")
    out.mkdir(parents=True, exist_ok=False)
    for f in hf.iterdir():  # tokenizer, generation config, ...: everything but the config and the weights
        if f.is_file() and f.name != "config.json" and not f.name.startswith("model") and f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    cfg["num_hidden_layers"] = layers
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][:layers]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _first_layers_weights(hf, out / "model.safetensors", layers)
    return cfg


def _first_layers_weights(hf: Path, out: Path, layers: int) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    files = sorted(hf.glob("*.safetensors"))
    if not files:
        raise SpecrtError(f"{hf} has no .safetensors weights: make it again with peer_models.ensure_hf_folder")
    kept = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                m = LAYER_KEY.search(key)
                if m is None or int(m.group(1)) < layers:
                    kept[key] = st.get_tensor(key)
    save_file(kept, str(out), metadata={"format": "pt"})


def _export(hf: Path, out: Path, log_file: Path) -> None:
    cmd = export_command(hf, out)
    with log_file.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not (out / "openvino_model.xml").is_file():
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-15:])
        raise SpecrtError(f"`{' '.join(cmd)}` failed (exit {rc}) on {hf}:\n{tail}")


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("openvino", "openvino-genai", "openvino-tokenizers", "optimum-intel", "nncf", "transformers",
                "torch"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def convert(hf: Path, final: Path, draft_layers: int | None = None, force: bool = False, log=print) -> Path:
    """OpenVINO's int4 model of `hf` (of its first `draft_layers` layers when given) at `final`, once."""
    if is_converted(final) and not force:
        log(f"openvino peer model: {final} (already converted)")
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    what = f"the first {draft_layers} layers of {hf}" if draft_layers else str(hf)
    log(f"openvino peer model: converting {what} to {final.name} (int4; a minute or two)...")
    with tempfile.TemporaryDirectory(prefix=f".{final.name}-", dir=final.parent) as tmp:
        tmp = Path(tmp)
        source, record = hf, {"hf": str(hf)}
        if draft_layers:
            source = tmp / "hf"
            cfg = truncated_hf_folder(hf, source, draft_layers)
            record["draft"] = {"layers": draft_layers, "of": json.loads((hf / "config.json").read_text())
                               ["num_hidden_layers"], "num_hidden_layers": cfg["num_hidden_layers"]}
        out = tmp / "out"
        _export(source, out, tmp / "export.log")
        seconds = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        record.update({"options": OPENVINO_OPTIONS, "command": export_command(Path("HF"), Path("OUT"), cli="optimum-cli"),
                       "versions": _versions(), "convert_seconds": round(seconds, 1), "bytes": size})
        (out / RECORD).write_text(json.dumps(record, indent=2))
        if final.exists():  # a stale or incomplete folder: move it out of the way, then drop it
            final.rename(tmp / "old")
        out.rename(final)
    log(f"openvino peer model: {final} ({size / 2**20:.0f} MiB, converted in {seconds:.0f} s)")
    return final


def convert_all(hf: Path, draft_layers: int = DRAFT_LAYERS, force: bool = False, log=print) -> tuple[Path, Path]:
    """The target and its `draft_layers`-layer draft, converted (each only once)."""
    hf = Path(hf)
    if not (hf / "config.json").is_file():
        raise SpecrtError(f"{hf} is not an HF model folder (no config.json): make it with "
                          "`python -c 'from specrt.tools.peer_models import ensure_hf_folder; ...'` in "
                          f"specrt's venv, or run `{SETUP_COMMAND}`")
    model = hf.name  # hf_dir(source) is named after peer_models.model_name(source)
    target = convert(hf, target_dir(model), force=force, log=log)
    draft = convert(hf, draft_dir(model, draft_layers), draft_layers=draft_layers, force=force, log=log)
    return target, draft


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m specrt.tools.openvino_models", description=__doc__.splitlines()[0])
    p.add_argument("--hf", type=Path, required=True, help="the peers' fp32 HF folder ($SPECRT_HOME/peers/hf/MODEL)")
    p.add_argument("--draft-layers", type=int, default=DRAFT_LAYERS,
                   help=f"layers of the draft model (default {DRAFT_LAYERS}, as `specrt export`)")
    p.add_argument("--force", action="store_true", help="convert again even when the models are there")
    args = p.parse_args(argv)
    try:
        convert_all(args.hf, args.draft_layers, args.force, log=lambda m: print(m, file=sys.stderr, flush=True))
    except SpecrtError as e:
        print(f"openvino-models: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
