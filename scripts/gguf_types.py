"""Each GGUF type specrt carries, on one model: the model file quantized into TYPE by llama.cpp's own quantizer
(llama-cpp-python, `make setup-peers`), exported to int4 (the file's own blocks), then measured.

    python scripts/gguf_types.py SOURCE.gguf --out DIR --types as-is,Q8_0,Q4_K_M     quantize, export, quality
    python scripts/gguf_types.py SOURCE.gguf --out DIR --speed --rounds 2            verify(k), rounds alternated
    python scripts/gguf_types.py SOURCE.gguf --out DIR --markdown FILE               the table of what is measured

Per type: the file's tensor types (by weight count), the file's and the bundle's bytes, `specrt validate
--quality` against the fp32 model of that file's values (teacher-forced perplexity ratio, top-1 agreement,
mean KL on held-out chat), and verify(k) through the native runtime (scripts/pass_costs.py, each type in its
own process). `as-is` is the source file itself. Results go to DIR/results.json, one entry a type, filled stage by stage, so a stopped run goes on.

Quantizing an already quantized file (the default model is Q4_1) rounds twice, so the quality columns say how
exactly specrt computes each file, not how good each type is against the original float model.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

AS_IS = "as-is"  # the source file itself, not quantized again
TYPES = f"{AS_IS},Q8_0,Q6_K,Q5_K_M,Q5_0,Q4_K_M,Q4_0,Q3_K_M,Q2_K,IQ4_NL,IQ4_XS"
QUALITY = ["--quality", "--quality-prompts", "20", "--quality-tokens", "64", "--json"]


def _quantize(source: Path, kind: str, dst: Path) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.allow_requantize = True
    params.nthread = 2
    tmp = dst.with_suffix(".part")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not quantize {source} into {kind}")
    tmp.rename(dst)


def _census(path: Path) -> dict:
    """The file's tensor types, as the share of its weights each holds."""
    from specrt.export.gguf_blocks import GGUFBlocks

    counts = Counter()
    for t in GGUFBlocks(path).tensors.values():
        counts[t.tensor_type.name] += int(t.n_elements)
    total = sum(counts.values())
    return {k: round(v / total, 3) for k, v in counts.most_common()}


def _size_mb(path: Path) -> float:
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    return round(sum(f.stat().st_size for f in files) / 1e6, 1)


SPECRT = str(Path(sys.executable).with_name("specrt"))


def _run(*args: str, ok: tuple = (0,)) -> str:
    proc = subprocess.run([*args], capture_output=True, text=True)
    if proc.returncode not in ok:
        raise SystemExit(f"{' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return proc.stdout


def prepare(source: Path, out: Path, kind: str, entry: dict) -> None:
    gguf, bundle = out / f"{source.stem.split('.')[0]}.{kind}.gguf", out / f"bundle-{kind}"
    if kind == AS_IS:
        gguf = source
    elif not gguf.exists():
        _quantize(source, kind, gguf)
    entry.update(file=str(gguf), file_mb=_size_mb(gguf), tensor_types=_census(gguf))
    if not (bundle / "manifest.json").exists():
        _run(SPECRT, "export", "--model", str(gguf), "-o", str(bundle),
             "--quantize", "int4", "--draft-layers", "0", "--no-parity-check")
    manifest = json.loads((bundle / "manifest.json").read_text())
    entry.update(bundle=str(bundle), bundle_mb=_size_mb(bundle),
                 from_model_file=manifest["artifacts"]["quantization"].get("from_model_file", {}))
    if "quality" not in entry:
        q = json.loads(_run(SPECRT, "validate", str(bundle), *QUALITY, ok=(0, 1)))["quality"]  # 1: out of bounds
        entry["quality"] = {k: q[k] for k in ("ratio", "top1_agreement", "kl", "positions", "verdict")}


def speed(results: dict, rounds: int) -> None:
    script = Path(__file__).with_name("pass_costs.py")
    for r in range(rounds):
        for kind, entry in results.items():
            out = _run(sys.executable, str(script), "verify", entry["bundle"], "--backend", "native", "--context", "200")
            ms = json.loads(out.strip().splitlines()[-1])["verify_ms"]
            entry.setdefault("verify_ms", []).append(ms)
            print(kind, r, ms, flush=True)


def markdown(results: dict) -> str:
    rows = ["| file | its tensor types (share of weights) | file MB | bundle MB | perplexity ratio | top-1 | KL | "
            "verify(1) / (2) / (4) / (8) ms |", "|---|---|---|---|---|---|---|---|"]
    for kind, e in results.items():
        q = e.get("quality", {})
        types = ", ".join(f"{k} {v:.0%}" for k, v in e.get("tensor_types", {}).items() if v >= 0.005)
        ms = " · ".join("/".join(f"{m[k]:.2f}" for k in ("1", "2", "4", "8")) for m in e.get("verify_ms", []))
        rows.append(f"| {kind} | {types} | {e.get('file_mb', '')} | {e.get('bundle_mb', '')} | {q.get('ratio', '')} | "
                    f"{q.get('top1_agreement', '')} | {q.get('kl', '')} | {ms} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--markdown", type=Path)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    store = a.out / "results.json"
    results = json.loads(store.read_text()) if store.exists() else {}
    if a.speed:
        speed(results, a.rounds)
    elif not a.markdown:
        for kind in a.types.split(","):
            entry = results.setdefault(kind, {})
            prepare(a.source, a.out, kind, entry)
            store.write_text(json.dumps(results, indent=1))
            print(kind, json.dumps(entry), flush=True)
    store.write_text(json.dumps(results, indent=1))
    if a.markdown:
        a.markdown.write_text(markdown(results))
        print(markdown(results))


if __name__ == "__main__":
    main()
