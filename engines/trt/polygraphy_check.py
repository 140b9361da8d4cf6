"""`specrt validate --polygraphy`: a bundle's graphs vs the PyTorch reference outputs saved at export.

Polygraphy runs each graph that has reference files (export/reference_io.py) on ONNX Runtime (CPU) on
the saved inputs and compares every output with the "pytorch" results. Where TensorRT is installed and
the manifest lists engines, the engines are compared with ONNX Runtime the same way.

Each comparison is held to the rule of its (graph precision, reference precision) pair, one table in
engines/trt/polygraphy_rules.py with the measurements behind every bound: max |Δ| against a multiple
of the output's range, and where the precision's noise needs it, cosine similarity. A failure names
the role, the output, the measured value and the bound.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specrt.engines.trt.polygraphy_rules import Rule, bound_of, rule_for
from specrt.errors import SpecrtError
from specrt.schema.manifest import Manifest

REFERENCE = "pytorch"
ORT = "onnxruntime"
TRT = "tensorrt"
SHOWN = 3  # failures named on the verdict line (every one is on its own line above)
REFERENCE_PRECISION = "fp32"  # export saves the fp32 PyTorch modules' outputs (export/reference_io.py)


def precision(manifest: Manifest) -> str:
    q = manifest.artifacts.get("quantization")
    return q["scheme"] if q else "fp32"


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


def compare(results, candidate: str, reference: str, rule: Rule) -> dict:
    """Polygraphy's comparison of runner `candidate` with `reference` (one iteration each in `results`)
    under `rule`: {output: {max_abs, max_rel, mean_abs, ref_peak, (bound, peak), (cosine, min_cosine),
    pass, (failed: [reason, ...])}}, and a failing entry for each reference output the candidate lacks."""
    from polygraphy.comparator import Comparator, CompareFunc
    from polygraphy.comparator.compare import CosineSimilarityCompareFunc

    got, want = results[candidate][0], results[reference][0]
    bounds = {name: bound_of(rule, name) for name in want.keys()}
    ref_peak = {name: float(np.max(np.abs(want[name]))) if np.size(want[name]) else 0.0 for name in want.keys()}
    atol = {name: b.peak * ref_peak[name] if b.peak is not None else np.inf for name, b in bounds.items()}
    funcs = [CompareFunc.simple(atol={**atol, "": 0.0}, rtol=0.0, check_error_stat="elemwise",
                                find_output_func=_exact)]
    cosine = {name: b.min_cosine for name, b in bounds.items() if b.min_cosine is not None}
    if cosine:
        funcs.append(CosineSimilarityCompareFunc(cosine_similarity_threshold={**cosine, "": -1.0},
                                                 find_output_func=_exact))
    accuracy = Comparator.compare_accuracy(results, compare_func=funcs, comparisons=[(0, 1)])
    report = {}
    for func_result in accuracy:
        for name, r in func_result[(candidate, reference)][0].items():
            entry = report.setdefault(name, {"pass": True, "failed": []})
            if isinstance(r, bool):  # Polygraphy's verdict without statistics: the shapes differ
                entry["pass"] = False
                entry["error"] = f"shape {list(got[name].shape)} vs {list(want[name].shape)}"
            elif hasattr(r, "cosine_similarity"):
                if name in cosine:
                    entry.update(cosine=r.cosine_similarity, min_cosine=cosine[name])
                    if not r.cosine_similarity >= cosine[name]:  # NaN fails
                        entry["failed"].append(f"cosine {r.cosine_similarity:.4f} < {cosine[name]:g}")
            else:
                entry.update(max_abs=float(r.max_absdiff), max_rel=float(r.max_reldiff),
                             mean_abs=float(r.mean_absdiff), ref_peak=ref_peak[name])
                peak = bounds[name].peak
                if peak is not None:
                    entry.update(bound=atol[name], peak=peak)
                if not np.isfinite(entry["max_abs"]):
                    entry["failed"].append(f"max|Δ| {entry['max_abs']} is not finite")
                elif peak is not None and not bool(r):
                    entry["failed"].append(f"max|Δ| {entry['max_abs']:.3e} > bound {atol[name]:.3e} "
                                           f"({peak:g} × max|ref| {ref_peak[name]:.3g})")
    for entry in report.values():
        entry["pass"] = entry["pass"] and not entry["failed"]
        if not entry["failed"]:
            del entry["failed"]
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


def _check(role: str, ran: tuple, vs: tuple, prec: str, ref_prec: str, graph: Path) -> dict:
    """One comparison: (runner name, its results) against (runner name, the reference's)."""
    from polygraphy.comparator import RunResults

    pair = RunResults()
    pair.append(ran)
    pair.append(vs)
    rule = rule_for(prec, ref_prec)
    return {"role": role, "backend": ran[0], "vs": vs[0], "precision": prec, "vs_precision": ref_prec,
            "rule": rule.basis, "graph": str(graph), "outputs": compare(pair, ran[0], vs[0], rule)}


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
                                     REFERENCE_PRECISION, path.relative_to(bundle)))
                if role in engines:  # NEVER RUN HERE (no TensorRT on the CPU machines): engine vs ONNX Runtime
                    from polygraphy.backend.common import BytesFromPath
                    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

                    engine, half = engines[role]
                    ran_trt = Comparator.run([TrtRunner(EngineFromBytes(BytesFromPath(str(engine))), name=TRT)],
                                             data_loader=feeds)
                    checks.append(_check(role, (TRT, ran_trt[TRT]), (ORT, ran[ORT]), half,
                                         prec, engine.relative_to(bundle)))
    except PolygraphyException as e:
        raise SpecrtError(f"Polygraphy failed: {str(e).strip().splitlines()[-1][:300]}") from None
    for c in checks:
        c["verdict"] = "pass" if all(o["pass"] for o in c["outputs"].values()) else "fail"
    return {"checks": checks, "verdict": "pass" if all(c["verdict"] == "pass" for c in checks) else "fail"}


def format_report(report: dict) -> list[str]:
    """One line per role/backend/output (its errors, bound, verdict); the last line the verdict, naming
    every output that failed, its value and the bound."""
    lines, failures = [], []
    for c in report["checks"]:
        lines.append(f"polygraphy {c['role']}: {c['backend']} ({c['graph']}, {c['precision']}) vs {c['vs']} "
                     f"({c['vs_precision']}) → {c['verdict']}   [rule: {c['rule']}]")
        for name, o in c["outputs"].items():
            verdict = "pass" if o["pass"] else "FAIL"
            why = [o["error"]] if "error" in o else o.get("failed", [])
            failures += [f"{c['role']} {c['backend']} {name}: {w}" for w in why]
            if "error" in o:
                lines.append(f"  {name:<18} {o['error']} → {verdict}")
                continue
            line = f"  {name:<18} max|Δ| {o['max_abs']:.3e}"
            if "bound" in o:
                line += f" (bound {o['bound']:.3e} = {o['peak']:g} × max|ref| {o['ref_peak']:.3g})"
            line += f"  mean|Δ| {o['mean_abs']:.3e}"
            if "cosine" in o:
                line += f"  cosine {o['cosine']:.4f} (min {o['min_cosine']:g})"
            lines.append(f"{line} → {verdict}")
    more = f" (and {len(failures) - SHOWN} more above)" if len(failures) > SHOWN else ""
    lines.append(f"polygraphy: {report['verdict']}" + (" — " + "; ".join(failures[:SHOWN]) + more if failures else ""))
    return lines
