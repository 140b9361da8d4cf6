"""Plots of training curves: held-out τ estimate against training time, one line per drafter kind."""

from __future__ import annotations

import json
from pathlib import Path


def plot_curves(metrics: dict[str, dict], path: Path, title: str = "specrt train") -> bool:
    """Write a PNG of each kind's curve; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for kind, m in metrics.items():
        curve = m["curve"]
        ax.plot([c["seconds"] / 60 for c in curve], [c["tau_est"] for c in curve], marker="o", ms=3, label=kind)
    ax.set_xlabel("training time on a 2-core CPU (min)")
    ax.set_ylabel("τ estimate, held-out prompts")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def load_metrics(folders: list[Path]) -> dict[str, dict]:
    out = {}
    for f in folders:
        p = Path(f) / "metrics.json"
        if p.is_file():
            m = json.loads(p.read_text())
            out[m["kind"]] = m
    return out
