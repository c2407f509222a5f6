"""The share of capacity the SLO policy keeps free: what its forecast cannot foresee, at the SLO's percentile.

The policy watches its own plans come true. Every `SAMPLE_S` it notes what it planned for (the load it asked
replicas for) and the smoothed load; one lead time later, the smoothed load over the plan is how far the load
outgrew the plan in the time a replica takes to arrive. The headroom is that ratio at the SLO's percentile over
the last `HISTORY_S` (never below 1): bursty or rising loads earn a larger one, steady ones none. Until it has
`MIN_SAMPLES` such ratios, the prior: arrivals over a lead time are Poisson and each brings a random amount of
work, so the work arriving spreads by `sqrt((1 + cv^2) / (arrivals per second * lead time))` around its mean,
taken at the percentile (a normal quantile) with cv^2 = 1 (work spread like an exponential).

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


def observed_headroom(state: dict[str, Any], now: float, planned: float, level: float, lead_s: float,
                      percentile: float) -> float | None:
    """Records this decision's plan and load in `state`; returns the headroom the history shows, or None while it
    is too short."""
    history = [row for row in state.get("plans", []) if now - row[0] <= HISTORY_S]
    if not history or now - history[-1][0] >= SAMPLE_S:
        history.append((now, planned, level))
    state["plans"] = history
    ratios = []
    later = 0
    for at, plan, _ in history:
        while later < len(history) and history[later][0] < at + lead_s:
            later += 1
        if later == len(history):
            break
        ratios.append(history[later][2] / max(plan, 1e-9))
    if len(ratios) < MIN_SAMPLES:
        return None
    return 1 - 1 / max(1.0, float(np.quantile(ratios, percentile)))
