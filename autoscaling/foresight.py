"""A bound, not a policy: the SLO policy's capacity planning with perfect foresight of the load.

`ForesightPolicy` is handed every request of the workload in advance. At each decision it looks one lead time
ahead (Serve's upscale delay, the start-up, the metrics' age: when a replica asked for now would serve) and asks
for the fewest replicas whose capacity at the SLO (autoscaling/capacity.py, for the workload's own request sizes)
covers the work that will arrive over the next `window_s`, less `headroom` of each replica. It pays Serve's delays,
start-ups and whole replicas like every policy, but no forecast error and no metric noise. Run at a few headrooms it
traces what replica-seconds buy with a perfect forecast: where even that saves little against Serve's curve, what
is left to save is not in the forecast (`make bench-autoscale BENCH_ARGS=--foresight`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autoscaling.capacity import SLO, CapacityModel, RequestSizes
from autoscaling.signals import DeploymentSignals
from autoscaling.slo_policy import lead_time_s
from autoscaling.step_model import ReplicaProfile
from autoscaling.workload import RequestSpec


@dataclass
class ForesightPolicy:
    requests: list[RequestSpec]
    profile: ReplicaProfile
    slo: SLO
    startup_s: float
    headroom: float = 0.0
    window_s: float = 30.0
    name: str = "foresight"
    _arrivals: np.ndarray = field(init=False, repr=False)
    _work: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.headroom < 1:
            raise ValueError(f"headroom is a share of capacity in [0, 1); got {self.headroom}")
        order = sorted(self.requests, key=lambda r: r.arrival_s)
        self._arrivals = np.array([r.arrival_s for r in order])
        # Every prompt token computed: the bound does not know what a prefix cache would serve.
        self._work = np.cumsum([0.0] + [r.prompt_tokens + r.output_tokens for r in order])
        sizes = RequestSizes(np.array([r.prompt_tokens for r in order], dtype=float), np.zeros(len(order)),
                             np.array([r.output_tokens for r in order], dtype=float))
        capacity = CapacityModel(self.profile, self.slo).capacity(sizes)
        self.pooled, self.alone = capacity.tokens_per_s, capacity.alone_tokens_per_s

    def load_at(self, start_s: float) -> float:
        """Tokens of work per second arriving over [start_s, start_s + window_s)."""
        first, last = np.searchsorted(self._arrivals, [start_s, start_s + self.window_s])
        return float(self._work[last] - self._work[first]) / self.window_s

    def __call__(self, signals: DeploymentSignals, state: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        load = self.load_at(signals.now + lead_time_s(signals, self.startup_s))
        keep = 1 - self.headroom
        if load <= self.alone * keep:
            return 1, state
        return max(2, math.ceil(load / max(self.pooled * keep, 1e-9))), state
