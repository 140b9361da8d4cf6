"""Models the peer engines need in their own format: `make peer-models` (`python -m specrt.tools.peer_models`).

onnxruntime-genai runs its own ONNX graph, made by its model builder from a Hugging Face folder. The
bundle's source (a GGUF, dequantized to fp32 by transformers, or an HF folder) is saved as an HF
folder, then built int4 for the CPU into `$SPECRT_HOME/peers/ortgenai/<model>-int4`:

    source ──load_model──▶ tmp/hf (fp32, no quantization_config) ──builder -p int4 -e cpu──▶ tmp/out
    tmp/out ──rename──▶ peers/ortgenai/<model>-int4   (never half-written: a folder there is complete)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.paths import home

# The builder's int4 options, passed explicitly and recorded beside the model: MatMulNBits blocks of 32
# weights, accuracy level 4 (activations quantized to int8 inside MatMulNBits: the builder's CPU default).
ORTGENAI_OPTIONS = {"precision": "int4", "execution_provider": "cpu", "block_size": 32, "accuracy_level": 4}
RECORD = "specrt_peer_model.json"  # written last into the temporary folder: its presence marks a complete build
BUILD_COMMAND = "make peer-models"


def model_name(source: str | Path) -> str:
    """The model's name from its source: the GGUF file's stem or the HF folder's name."""
    path = Path(source)
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def ortgenai_dir(source: str | Path) -> Path:
    """Where the onnxruntime-genai int4 model of `source` lives (built or not)."""
    return home() / "peers" / "ortgenai" / f"{model_name(source)}-int4"


def hf_dir(source: str | Path) -> Path:
    """Where the source's plain fp32 Hugging Face folder lives (the input of every peer's own
    conversion: onnxruntime-genai's builder, vLLM, OpenVINO's optimum-intel export)."""
    return home() / "peers" / "hf" / model_name(source)


HF_RECORD = "specrt_hf_folder.json"  # written last: its presence marks a complete folder


def ensure_hf_folder(source: str | Path, log=print) -> Path:
    """The source saved once as an fp32 HF folder at `hf_dir(source)` (written beside, then renamed)."""
    source = str(source)
    final = hf_dir(source)
    if (final / HF_RECORD).is_file():
        return final
    if not Path(source).exists():
        raise SpecrtError(f"the peers' HF folder is made from the bundle's source {source}, which does not "
                          "exist: put it back or export the bundle again")
    final.parent.mkdir(parents=True, exist_ok=True)
    log(f"peer HF folder: saving {source} as fp32 into {final}...")
    with tempfile.TemporaryDirectory(prefix=f".{final.name}-", dir=final.parent) as tmp:
        tmp = Path(tmp)
        _save_hf_folder(source, tmp / "hf")
        (tmp / "hf" / HF_RECORD).write_text(json.dumps({"source": source}, indent=2))
        if final.exists():  # an incomplete folder: move it out of the way, then drop it
            final.rename(tmp / "old")
        (tmp / "hf").rename(final)
    return final


def is_built(folder: Path) -> bool:
    return (folder / RECORD).is_file() and (folder / "genai_config.json").is_file()


def _save_hf_folder(source: str, folder: Path) -> None:
    """The source as a plain fp32 Hugging Face folder the builder reads (no GGUF quantization_config)."""
    from specrt.export.loading import load_model

    loaded = load_model(source)
    hf = loaded.hf_model
    # transformers refuses to save a model it loaded through its GGUF quantizer; its weights are fp32 here
    hf.hf_quantizer = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)  # the weights are fp32 now; the builder would misread it
    cfg_path.write_text(json.dumps(cfg, indent=2))


def _run_builder(hf: Path, out: Path, cache: Path, log: Path) -> None:
    o = ORTGENAI_OPTIONS
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
           "-p", o["precision"], "-e", o["execution_provider"], "-c", str(cache),
           "--extra_options", f"block_size={o['block_size']}", f"accuracy_level={o['accuracy_level']}"]
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not (out / "genai_config.json").is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise SpecrtError(f"the onnxruntime-genai model builder failed (exit {rc}) on {hf}:\n{tail}")


def build_ortgenai(source: str | Path, force: bool = False, log=print) -> Path:
    """Build the onnxruntime-genai int4 CPU model of `source` once; returns its folder."""
    try:
        import onnxruntime_genai
    except ImportError:
        raise SpecrtError("building the ortgenai peer model needs onnxruntime-genai: "
                          "pip install 'specrt[peers]'") from None
    source = str(source)
    if not Path(source).exists():
        raise SpecrtError(f"the ortgenai peer model is built from the bundle's source {source}, which does not "
                          "exist: put it back or export the bundle again")
    final = ortgenai_dir(source)
    if is_built(final) and not force:
        log(f"ortgenai peer model: {final} (already built)")
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    log(f"ortgenai peer model: building {final.name} from {source} with onnxruntime-genai "
        f"{onnxruntime_genai.__version__} (int4, CPU; a minute or two)...")
    # the temporary folder sits beside the final one, so the last step is a rename on one file system
    hf = ensure_hf_folder(source, log)
    with tempfile.TemporaryDirectory(prefix=f".{final.name}-", dir=final.parent) as tmp:
        tmp = Path(tmp)
        out = tmp / "out"
        _run_builder(hf, out, tmp / "cache", tmp / "builder.log")
        seconds = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        record = {"source": source, "onnxruntime_genai": onnxruntime_genai.__version__,
                  "options": ORTGENAI_OPTIONS, "build_seconds": round(seconds, 1), "bytes": size}
        (out / RECORD).write_text(json.dumps(record, indent=2))
        if final.exists():  # a stale or incomplete folder: move it out of the way, then drop it
            old = tmp / "old"
            final.rename(old)
        out.rename(final)
    log(f"ortgenai peer model: {final} ({size / 2**20:.0f} MiB, built in {seconds:.0f} s)")
    return final


def main(argv: list[str] | None = None) -> None:
    from specrt.paths import default_bundle
    from specrt.schema.manifest import Manifest

    p = argparse.ArgumentParser(prog="python -m specrt.tools.peer_models", description=__doc__.splitlines()[0])
    p.add_argument("bundle", nargs="?", type=Path, default=None,
                   help="bundle whose source model to build from (default: the default bundle)")
    p.add_argument("--source", type=Path, default=None,
                   help="the source model itself (a .gguf file or HF folder) instead of a bundle's")
    p.add_argument("--force", action="store_true", help="rebuild even when the model is there")
    args = p.parse_args(argv)
    try:
        source = args.source or Manifest.load(args.bundle or default_bundle()).target.source
        build_ortgenai(source, force=args.force, log=lambda m: print(m, file=sys.stderr, flush=True))
    except SpecrtError as e:
        print(f"peer-models: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
