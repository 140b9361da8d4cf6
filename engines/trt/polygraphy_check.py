"""`specrt validate --polygraphy`: a bundle's graphs vs the PyTorch reference outputs saved at export.

Polygraphy runs each graph that has reference files (export/reference_io.py) on ONNX Runtime (CPU) on
the saved inputs and compares every output with the "pytorch" results, with tolerances chosen by the
bundle's precision. Where TensorRT is installed and the manifest lists engines, the engines are
compared with ONNX Runtime the same way.

Tolerances, by precision (Polygraphy's `simple` comparison; per output, "" is the default):
  fp32   elemwise atol 1e-3 / rtol 1e-3 (an element fails only if it exceeds both): export's parity
         tolerance; the graphs measure a few 1e-5 on logits.
  int4 / int8 (weight-only MatMulNBits vs the fp32 module): per element the error *is* the quantization
         noise (max |Δlogits| 11.6 on the default int4 bundle), so the check is on the mean absolute
         error plus Polygraphy's cosine similarity per output, at about 2x the measured error of the
         default int4 SmolLM2-135M bundle (target; a 6-token tree window over seeded random ids):
             output          mean |Δ| measured / atol     cosine measured / minimum
             logits          1.88 / 4.0                   0.986 / 0.95
             hidden_states   0.56 / 1.5                   0.923 / 0.8
             aux_hidden      7.54 / 20                    0.998 / 0.95
             present KV      <= 0.23 / 0.5                >= 0.729 / 0.5
         int8 uses the same (not measured: its noise is ~16x smaller than int4's).
  TensorRT fp16 / bf16 vs ONNX Runtime fp32: elemwise atol 5e-2 / rtol 5e-2 (never run on this machine).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.schema.manifest import Manifest

REFERENCE = "pytorch"
ORT = "onnxruntime"
TRT = "tensorrt"



@dataclass(frozen=True)
class Tolerance:
    atol: float | dict
    rtol: float | dict
    stat: str  # Polygraphy's check_error_stat
    cosine: float | dict | None = None  # minimum cosine similarity per output, if checked


FP32 = Tolerance(1e-3, 1e-3, "elemwise")
QUANTIZED = Tolerance({"logits": 4.0, "hidden_states": 1.5, "aux_hidden_states": 20.0, "": 0.5}, 0.0, "mean",
                      {"logits": 0.95, "hidden_states": 0.8, "aux_hidden_states": 0.95, "": 0.5})
HALF = Tolerance(5e-2, 5e-2, "elemwise")  # TensorRT fp16 / bf16 engines vs ONNX Runtime fp32


def _per_output(value, name: str):
    return value.get(name, value[""]) if isinstance(value, dict) else value


def precision(manifest: Manifest) -> str:
    q = manifest.artifacts.get("quantization")
    return q["scheme"] if q else "fp32"


def tolerance_for(name: str) -> Tolerance:
    if name == "fp32":
        return FP32
    if name in ("int4", "int8"):
        return QUANTIZED
    if name in ("fp16", "bf16"):
        return HALF
    raise SpecrtError(f"no Polygraphy tolerance for precision {name!r}")


def reference_files(bundle: Path, manifest: Manifest) -> dict[str, tuple[Path, Path]]:
    """(inputs, outputs) per role, or one clear error saying to re-export."""
    records = manifest.artifacts.get("reference_io") or {}
    how = (f"export the bundle again (`specrt export -o {bundle}`, with Polygraphy installed: "
           "`pip install polygraphy`) to save the PyTorch reference inputs/outputs")
    if not records:
        raise SpecrtError(f"bundle {bundle} has no PyTorch reference outputs for --polygraphy: {how}")
    files = {}
    for role, rec in records.items():
        paths = (Path(bundle) / rec["inputs"], Path(bundle) / rec["outputs"])
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise SpecrtError(f"reference files of {role} are missing ({', '.join(missing)}): {how}")
        files[role] = paths
    return files


def _exact(name, index, iter_result):  # Polygraphy's default also matches by substring and by position
    return [name] if name in iter_result else None


def compare(results, candidate: str, reference: str, tol: Tolerance) -> dict:
    """Polygraphy's comparison of runner `candidate` with `reference` (one iteration each in `results`):
    {output: {max_abs, max_rel, mean_abs, atol, rtol, stat, (cosine, min_cosine), pass}}, and a failing
    entry for each reference output the candidate does not produce."""
    from polygraphy.comparator import Comparator, CompareFunc
    from polygraphy.comparator.compare import CosineSimilarityCompareFunc

    funcs = [CompareFunc.simple(atol=tol.atol, rtol=tol.rtol, check_error_stat=tol.stat, find_output_func=_exact)]
    if tol.cosine is not None:
        funcs.append(CosineSimilarityCompareFunc(cosine_similarity_threshold=tol.cosine, find_output_func=_exact))
    accuracy = Comparator.compare_accuracy(results, compare_func=funcs, comparisons=[(0, 1)])
    got, want = results[candidate][0], results[reference][0]
    report = {}
    for func_result in accuracy:
        for name, r in func_result[(candidate, reference)][0].items():
            entry = report.setdefault(name, {"pass": True})
            entry["pass"] = entry["pass"] and bool(r)
            if isinstance(r, bool):  # Polygraphy's verdict without statistics: the shapes differ
                entry["error"] = f"shape {list(got[name].shape)} vs {list(want[name].shape)}"
            elif hasattr(r, "cosine_similarity"):
                entry.update(cosine=r.cosine_similarity, min_cosine=_per_output(tol.cosine, name))
            else:
                entry.update(max_abs=r.max_absdiff, max_rel=r.max_reldiff, mean_abs=r.mean_absdiff,
                             atol=_per_output(tol.atol, name), rtol=_per_output(tol.rtol, name), stat=tol.stat)
    for name in want.keys():
        if name not in got.keys():
            report[name] = {"pass": False, "error": f"the {candidate} graph has no output {name}"}
    return report


def _ort_runner(path: Path, threads: int):
    import onnxruntime as ort
    from polygraphy.backend.onnxrt import OnnxrtRunner

    from specrt.engines.ort_cpu.runner import session_options

    if not path.is_file():
        raise SpecrtError(f"ONNX graph {path} is missing: export the bundle again")
    # the runtime's own session settings (threads); Polygraphy's SessionFromOnnx has no session options
    return OnnxrtRunner(lambda: ort.InferenceSession(str(path), session_options(threads),
                                                     providers=["CPUExecutionProvider"]), name=ORT)


def _trt_engines(bundle: Path, manifest: Manifest) -> dict:
    """{role: (engine path, precision)} of built TensorRT engines — if TensorRT is installed and the
    manifest lists any (`specrt build --backend trt` writes artifacts.tensorrt: {"precision", "graphs":
    {role: {"file", ...}}}, see engines/trt/profiles.py::manifest_entry)."""
    from specrt.engines.trt.build import tensorrt_available

    entry = manifest.artifacts.get("tensorrt", {})
    engines = entry.get("graphs", {})
    if not engines or not tensorrt_available():
        return {}
    return {role: (Path(bundle) / e["file"], entry.get("precision", "fp16")) for role, e in engines.items()}


def _check(role: str, ran: tuple, vs: tuple, prec: str, graph: Path) -> dict:
    """One comparison: (runner name, its results) against (runner name, the reference's)."""
    from polygraphy.comparator import RunResults

    pair = RunResults()
    pair.append(ran)
    pair.append(vs)
    return {"role": role, "backend": ran[0], "vs": vs[0], "precision": prec, "graph": str(graph),
            "outputs": compare(pair, ran[0], vs[0], tolerance_for(prec))}


def polygraphy_check(bundle: Path, threads: int = 2, trt: bool | None = None) -> dict:
    """Check every graph with reference files; returns {"checks": [...], "verdict": "pass"|"fail"}.
    trt: None = compare TensorRT engines with ONNX Runtime where possible, False = never, True = require."""
    try:
        from polygraphy.comparator import Comparator, RunResults
        from polygraphy.exception import PolygraphyException
        from polygraphy.json import load_json
        from polygraphy.logger import G_LOGGER
    except ImportError:
        raise SpecrtError("--polygraphy needs Polygraphy: `pip install polygraphy`") from None

    bundle = Path(bundle)
    manifest = Manifest.load(bundle)
    files = reference_files(bundle, manifest)
    prec = precision(manifest)
    engines = _trt_engines(bundle, manifest) if trt is not False else {}
    if trt and not engines:
        raise SpecrtError("--polygraphy with TensorRT: no TensorRT engines in this bundle, or TensorRT is not "
                          "installed (build them with `specrt build --backend trt` on a GPU machine)")
    checks = []
    try:
        with G_LOGGER.verbosity(G_LOGGER.CRITICAL):  # our report replaces Polygraphy's log
            for role, (inputs, outputs) in files.items():
                feeds = load_json(inputs, description=f"{role} reference inputs")
                reference = RunResults.load(outputs)
                path = manifest.onnx_path(bundle, role)
                ran = Comparator.run([_ort_runner(path, threads)], data_loader=feeds)
                checks.append(_check(role, (ORT, ran[ORT]), (REFERENCE, reference[REFERENCE]), prec,
                                     path.relative_to(bundle)))
                if role in engines:  # NEVER RUN HERE (no TensorRT on the CPU machines): engine vs ONNX Runtime
                    from polygraphy.backend.common import BytesFromPath
                    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

                    engine, half = engines[role]
                    ran_trt = Comparator.run([TrtRunner(EngineFromBytes(BytesFromPath(str(engine))), name=TRT)],
                                             data_loader=feeds)
                    checks.append(_check(role, (TRT, ran_trt[TRT]), (ORT, ran[ORT]), half,
                                         engine.relative_to(bundle)))
    except PolygraphyException as e:
        raise SpecrtError(f"Polygraphy failed: {str(e).strip().splitlines()[-1][:300]}") from None
    for c in checks:
        c["verdict"] = "pass" if all(o["pass"] for o in c["outputs"].values()) else "fail"
    return {"checks": checks, "verdict": "pass" if all(c["verdict"] == "pass" for c in checks) else "fail"}


def format_report(report: dict) -> list[str]:
    """One line per role/backend/output: errors, tolerance, verdict."""
    lines = []
    for c in report["checks"]:
        lines.append(f"polygraphy {c['role']}: {c['backend']} ({c['graph']}, {c['precision']}) vs {c['vs']} "
                     f"→ {c['verdict']}")
        for name, o in c["outputs"].items():
            verdict = "pass" if o["pass"] else "FAIL"
            if "error" in o:
                lines.append(f"  {name:<18} {o['error']} → {verdict}")
                continue
            line = (f"  {name:<18} max|Δ| {o['max_abs']:.3e}  max rel {o['max_rel']:.3e}  mean|Δ| {o['mean_abs']:.3e}"
                    f"  tol: {o['stat']} atol {o['atol']:g} rtol {o['rtol']:g}")
            if "cosine" in o:
                line += f"  cosine {o['cosine']:.4f} (min {o['min_cosine']:g})"
            lines.append(f"{line} → {verdict}")
    lines.append(f"polygraphy: {report['verdict']}")
    return lines
