"""Plots of training curves: held-out τ estimate against training tokens seen and
training time, one line per drafter kind."""

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
    fig, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for kind, m in metrics.items():
        curve = m["curve"]
        tau = [c["tau_est"] for c in curve]
        if all("tokens_seen" in c for c in curve):  # curves recorded before tokens were counted have none
            by_tokens.plot([c["tokens_seen"] / 1000 for c in curve], tau, marker="o", ms=3, label=kind)
        by_time.plot([c["seconds"] / 60 for c in curve], tau, marker="o", ms=3, label=kind)
    by_tokens.set_xlabel("training tokens seen (thousands)")
    by_tokens.set_ylabel("τ estimate, held-out prompts")
    by_time.set_xlabel("training time on a 2-core CPU (min)")
    for ax in (by_tokens, by_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)  # never a half-written plot under the real name
    return True


def load_metrics(folders: list[Path]) -> dict[str, dict]:
    out = {}
    for f in folders:
        p = Path(f) / "metrics.json"
        if p.is_file():
            m = json.loads(p.read_text())
            out[m["kind"]] = m
    return out
