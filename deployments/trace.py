"""Fetch the step trace of a running app as Chrome-trace JSON, and draw a short window of it as a PNG.

    python -m deployments.trace --url http://127.0.0.1:8000 --seconds 10 --out trace.json --png timeline.png
    python -m deployments.trace --from trace.json --png timeline.png --png-seconds 2

Open the JSON in https://ui.perfetto.dev or chrome://tracing. The PNG has, per engine replica, a row of engine
steps (prefill-carrying steps apart from decode-only ones) and rows of requests coloured by stage.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

log = logging.getLogger("tokenline.trace")

STAGE_COLOURS = {"tokenize": "#8c564b", "dispatch": "#c49c94", "route": "#e377c2", "to_engine": "#7f7f7f",
                 "admit": "#bcbd22", "queue": "#d62728", "prefill": "#ff7f0e", "preempted": "#9467bd",
                 "decode": "#1f77b4", "emit": "#17becf", "from_engine": "#7f7f7f", "respond": "#2ca02c",
                 "send": "#98df8a", "engine": "#aec7e8"}
STEP_COLOURS = {"decode": "#1f77b4", "prefill": "#ff7f0e", "prefill+decode": "#ffbb78"}


def fetch(url: str, seconds: float, api_key: str | None, timeout_s: float = 120.0) -> dict[str, Any]:
    query = urllib.parse.urlencode({"seconds": seconds})
    request = urllib.request.Request(f"{url.rstrip('/')}/debug/trace?{query}")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def render_png(trace: dict[str, Any], path: Path, window_s: float) -> Path:
    """The last `window_s` seconds of the trace: one block of rows per process, steps first, then request lanes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = trace["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("step", "stage")]
    if not spans:
        raise ValueError("the trace holds no steps and no requests: send some requests, then fetch it again")
    end_us = max(e["ts"] + e["dur"] for e in spans)
    start_us = max(min(e["ts"] for e in spans), end_us - window_s * 1e6)
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    rows = sorted({(e["pid"], e["tid"]) for e in spans})
    row_of = {key: i for i, key in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(14, max(4.0, 1.0 + 0.35 * len(rows))))
    for e in spans:
        if e["ts"] + e["dur"] < start_us:
            continue
        colour = (STEP_COLOURS.get(e["name"][6:-1], "#1f77b4") if e["cat"] == "step"
                  else STAGE_COLOURS.get(e["name"], "#cccccc"))
        ax.broken_barh([((e["ts"] - start_us) / 1e3, max(e["dur"] / 1e3, 0.05))],
                       (row_of[(e["pid"], e["tid"])] - 0.4, 0.8), facecolors=colour, edgecolor="white",
                       linewidth=0.2)
    labels = [f"{names.get(pid, pid)[:28]} · {'steps' if tid == 0 else f'requests {tid}'}" for pid, tid in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, (end_us - start_us) / 1e3)
    ax.set_xlabel("ms")
    ax.set_title(f"tokenline: the last {(end_us - start_us) / 1e6:.1f} s of the trace")
    legend = [Patch(color=c, label=f"step: {k}") for k, c in STEP_COLOURS.items()]
    used = {e["name"] for e in spans if e["cat"] == "stage"}
    legend += [Patch(color=c, label=k) for k, c in STAGE_COLOURS.items() if k in used]
    ax.legend(handles=legend, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", help="the app's HTTP address, e.g. http://127.0.0.1:8000")
    source.add_argument("--from", dest="from_file", type=Path, help="a trace JSON written earlier")
    parser.add_argument("--seconds", type=float, default=10.0, help="how far back the trace reaches")
    parser.add_argument("--api-key", default=os.environ.get("TOKENLINE_ADMIN_KEY"),
                        help="the admin key, when the app has keys on (default: $TOKENLINE_ADMIN_KEY)")
    parser.add_argument("--out", type=Path, help="where to write the trace JSON")
    parser.add_argument("--png", type=Path, help="where to draw the PNG")
    parser.add_argument("--png-seconds", type=float, default=3.0, help="the window the PNG shows (the latest)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    trace = json.loads(args.from_file.read_text()) if args.from_file else fetch(args.url, args.seconds, args.api_key)
    other = trace.get("otherData", {})
    log.info("%d trace events: %s engine replicas, %s requests", len(trace["traceEvents"]),
             other.get("engine_replicas", "?"), other.get("requests", "?"))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(trace))
        log.info("wrote %s (open it in https://ui.perfetto.dev)", args.out)
    if args.png:
        log.info("wrote %s", render_png(trace, args.png, args.png_seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
