"""What the SLO policy holds beyond its forecast: what the forecast cannot foresee, at the SLO's percentile.

The policy watches its own plans come true. Every `SAMPLE_S` it notes what it planned for (the load it asked
replicas for) and the smoothed load; one lead time later, the smoothed load less the plan is how far the load
outgrew the plan in the time a replica takes to arrive, read back to the step that would have moved the smoothed
load that far. The surprise is that excess at the SLO's percentile of requests over the last `HISTORY_S` (never
below 0), in tokens/s, held on top of the plan up to the highest load of the history:
bursty or stepping loads earn capacity held for their next burst, steady ones none, and a load at its peak needs
none beyond it. (A ratio of load to plan, as first built, multiplied a burst's height onto the burst itself: 12
replicas for a load 5 covered.) Until it has `MIN_SAMPLES` such excesses, the prior, a share of capacity: arrivals
over a lead time are Poisson and each brings a random amount of work, so the work arriving spreads by
`sqrt((1 + cv^2) / (arrivals per second * lead time))` around its mean, taken at the percentile (a normal
quantile) with cv^2 = 1 (work spread like an exponential).

The history lives in the policy's state (Serve's `policy_state`): at most `HISTORY_S / SAMPLE_S` rows.
"""
from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

import numpy as np

SAMPLE_S = 5.0
HISTORY_S = 1200.0
MIN_SAMPLES = 24  # two minutes of ratios
WORK_CV2 = 1.0  # squared coefficient of variation of a request's work, for the prior
MAX_PRIOR = 0.5


def prior_headroom(arrivals_per_s: float, lead_s: float, percentile: float) -> float:
    """The share of capacity the load's Poisson randomness over one lead time takes, at the percentile."""
    expected = arrivals_per_s * lead_s
    if expected <= 0:
        return MAX_PRIOR
    spread = math.sqrt((1 + WORK_CV2) / expected)
    z = NormalDist().inv_cdf(percentile)
    return min(MAX_PRIOR, z * spread / (1 + z * spread))


def observed_surprise(state: dict[str, Any], now: float, planned: float, level: float, lead_s: float,
                      percentile: float, rise: float = 1.0) -> float | None:
    """Records this decision's plan and load in `state`; returns the tokens/s to hold beyond `planned`, or None
    while the history is too short. `rise` is the share of a step in the load that the smoothed `level` shows one
    lead time after it (`1 - exp(-lead / level time)`): each excess is divided by it, so that a burst is held at
    its height, not at the part of it the smoothed load had reached (about half, at 45 s and a 31 s lead).

    That is how far the load outgrew the plans one lead time later, at the percentile of the load it met (of
    requests, not of time), in tokens/s (a burst adds its height whatever the level it starts from), and never
    past the highest load of the history: a load already at its peak has no burst left to meet."""
    history = [row for row in state.get("plans", []) if now - row[0] <= HISTORY_S]
    if not history or now - history[-1][0] >= SAMPLE_S:
        history.append((now, planned, level))
    state["plans"] = history
    excesses, loads = [], []
    later = 0
    for at, plan, _ in history:
        while later < len(history) and history[later][0] < at + lead_s:
            later += 1
        if later == len(history):
            break
        excesses.append((history[later][2] - plan) / rise)
        loads.append(history[later][2])
    if len(excesses) < MIN_SAMPLES:
        return None
    peak = max(row[2] for row in history)
    return min(max(0.0, _weighted_quantile(excesses, loads, percentile)), max(0.0, peak - planned))


def _weighted_quantile(values: list[float], weights: list[float], q: float) -> float:
    """The value below which `q` of the total weight lies. Each excess weighs the load it met: the percentile is
    of requests, and a burst brings more of them than its share of the time."""
    order = np.argsort(values)
    cumulative = np.cumsum(np.maximum(np.asarray(weights, dtype=float)[order], 1e-9))
    index = int(np.searchsorted(cumulative, q * cumulative[-1]))
    return float(np.asarray(values, dtype=float)[order][min(index, len(values) - 1)])
