"""The benchmarks' picture: their JSON rows as grouped bars, one panel per metric, written beside the JSON."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtests.plot import pyplot, save_figure


def plot_bars(rows: Sequence[Mapping[str, Any]], x: str, series: str, metrics: Mapping[str, str], path: Path,
              title: str = "") -> Path:
    """One panel per metric (`metrics`: row field -> axis label); in each, a group of bars per value of `x` and a
    bar per value of `series`, in the rows' order. A row without a metric (or with NaN) has no bar in that panel."""
    groups = list(dict.fromkeys(str(row[x]) for row in rows))
    names = list(dict.fromkeys(str(row[series]) for row in rows))
    width = 0.8 / max(len(names), 1)
    fig, axes = pyplot().subplots(1, len(metrics), figsize=(4.2 * len(metrics) + 1.5, 4.2), squeeze=False,
                                  constrained_layout=True)
    for ax, (metric, label) in zip(axes[0], metrics.items()):
        for i, name in enumerate(names):
            values = {str(row[x]): row.get(metric) for row in rows if str(row[series]) == name}
            bars = [(g, float(v)) for g, v in values.items() if v is not None and v == v]
            ax.bar([groups.index(g) + (i - (len(names) - 1) / 2) * width for g, _ in bars], [v for _, v in bars],
                   width, label=name)
        ax.set_xticks(range(len(groups)), groups)
        ax.set_xlabel(x)
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    legend = {label: handle for ax in axes[0] for handle, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(legend.values(), legend.keys(), loc="outside lower center", ncol=min(len(names), 4), fontsize=8)
    return save_figure(fig, path, title)
