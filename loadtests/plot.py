"""The sweep picture: output token throughput against TTFT and ITL percentiles, one point per load level."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from loadtests.summary import RunSummary


def pyplot() -> Any:
    """matplotlib.pyplot drawing to files only, never a window (imported late: matplotlib is the bench extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, title: str = "") -> Path:
    if title:
        fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def plot_sweep(points: list[tuple[str, RunSummary]], path: Path, title: str = "") -> Path:
    fig, axes = pyplot().subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    x = [s.value("output_token_throughput") or 0.0 for _, s in points]
    for ax, tag, name in ((axes[0], "time_to_first_token", "TTFT"), (axes[1], "inter_token_latency", "ITL")):
        for stat, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            y = [s.value(tag, stat) for _, s in points]
            pairs = [(a, b) for a, b in zip(x, y) if b is not None]
            if pairs:
                ax.plot([a for a, _ in pairs], [b for _, b in pairs], style, label=f"{name} {stat}")
        for (label, s), xv in zip(points, x):
            yv = s.value(tag, "p50")
            if yv is not None:
                ax.annotate(label, (xv, yv), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel("output token throughput (tokens/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path, title)
