"""`specrt-run`: the standalone runtime — run a bundle (generate, serve, bench, info) with only the
runtime's dependencies installed (`pip install specrt`, no extras: no torch, no transformers).

It registers the runtime's command modules only; `specrt` (specrt.cli) has every command, export included.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from specrt import __version__
from specrt.cli import register, run
from specrt.cli.options import available_drafters, bundle_argument, resolve_bundle

# `specrt.cli.<module>` command modules that need nothing beyond `[project] dependencies`, at import
# and at run time. A module listed here must not import torch, transformers or the exporter.
RUNTIME_COMMAND_MODULES = ("generate_cmd", "serve_cmd", "bench_cmd")

# manifest.artifacts entries that are not built engines
_NOT_BACKENDS = ("parity_max_abs_logits", "quantization", "reference_io")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="specrt-run")
def cli() -> None:
    """specrt-run: run a specrt bundle (generate, serve, bench, info) with the runtime alone — ONNX Runtime,
    tokenizers, numpy; no torch. Export bundles with `specrt export` (`pip install 'specrt[export]'`)."""


def summary(bundle: Path) -> dict:
    """What `specrt-run info` prints: the manifest's model, graphs, drafters, quantization, engines."""
    from specrt.schema.manifest import Manifest

    m = Manifest.load(bundle)
    cfg = m.target.config
    built = {k: v for k, v in m.artifacts.items() if k not in _NOT_BACKENDS and isinstance(v, dict)}
    q = m.artifacts.get("quantization") or {}
    return {
        "bundle": str(bundle),
        "model": {"source": m.target.source, "model_type": cfg.model_type, "num_layers": cfg.num_layers,
                  "hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
                  "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings},
        "graphs": {role: {"file": g.file, "num_layers": g.config.num_layers, "opset": g.opset,
                          "built": sorted(b for b, a in built.items() if role in (a.get("graphs") or {}))}
                   for role, g in m.graphs.items()},
        "drafters": available_drafters(m),
        "learned_drafters": sorted(m.drafters),
        "quantization": ({"scheme": q.get("scheme"), "bits": q.get("bits"), "block_size": q.get("block_size"),
                          "op": q.get("op")} if q else None),
        "backends": sorted(built),
        "runtime_defaults": m.runtime_defaults,
        "versions": m.versions,
    }


def _print_summary(s: dict) -> None:
    md = s["model"]
    rows = [("bundle", s["bundle"]),
            ("model", f"{md['model_type']}, {md['num_layers']} layers, hidden {md['hidden_size']}, "
                      f"{md['num_heads']} heads ({md['num_kv_heads']} kv), vocab {md['vocab_size']}, "
                      f"max positions {md['max_position_embeddings']}"),
            ("source", md["source"] or "-")]
    for i, (role, g) in enumerate(s["graphs"].items()):
        built = f"  [built: {', '.join(g['built'])}]" if g["built"] else ""
        layers = f" ({g['num_layers']} layers)" if role in ("target", "draft") else ""  # others: target's config
        rows.append(("graphs" if i == 0 else "", f"{role:<12} {g['file']}{layers}{built}"))
    rows.append(("drafters", ", ".join(s["drafters"])))
    q = s["quantization"]
    rows.append(("quantization", f"{q['scheme']} ({q['op']}, {q['bits']}-bit, block {q['block_size']})" if q
                 else "none (fp32 weights)"))
    rows.append(("engines", ", ".join(s["backends"]) or "none (run `specrt build`; plain ONNX graphs are used)"))
    d = s["runtime_defaults"]
    if d:
        opts = ", ".join(f"{k}={v}" for k, v in d.items() if k not in ("drafter", "tuned"))
        rows.append(("tuned default", f"{d.get('drafter', 'plain')}" + (f" ({opts})" if opts else "")))
    rows.append(("exported with", ", ".join(f"{k} {v}" for k, v in s["versions"].items())))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        click.echo(f"{k:<{width}}  {v}")


@click.command("info")
@bundle_argument
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def info(bundle, as_json):
    """Summarize BUNDLE's manifest: model, graphs, drafters, quantization, built engines."""
    s = summary(resolve_bundle(bundle))
    if as_json:
        click.echo(json.dumps(s, indent=2))
    else:
        _print_summary(s)


register(cli, RUNTIME_COMMAND_MODULES)
cli.add_command(info)


def main() -> None:
    run(cli, "specrt-run")
