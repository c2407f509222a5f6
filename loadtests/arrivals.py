"""When requests are sent: arrival processes for a request rate, user curves for Locust shapes, the load mode."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

ArrivalKind = Literal["constant", "poisson", "gamma"]


def arrival_offsets(n: int, rate: float, kind: ArrivalKind = "poisson", burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """Send times (s after the start) of n requests at `rate` requests/s on average.

    constant: evenly spaced; poisson: exponential gaps; gamma: gaps drawn from Gamma(shape=burstiness,
    scale=1/(rate*burstiness)), the `vllm bench serve --burstiness` convention: burstiness 1 is Poisson,
    below 1 burstier, above 1 more regular. The first request goes at 0.
    """
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if n <= 0:
        return []
    if kind == "constant":
        gaps = np.full(n - 1, 1.0 / rate)
    elif kind == "poisson":
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n - 1)
    elif kind == "gamma":
        if burstiness <= 0:
            raise ValueError(f"burstiness must be positive, got {burstiness}")
        gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n - 1)
    else:
        raise ValueError(f"unknown arrival process {kind!r}: use constant, poisson or gamma")
    return [0.0] + np.cumsum(gaps).tolist()


def step_users(t: float, step_users: int, step_time: float, max_users: int) -> int:
    """Users at time t: one more step of `step_users` every `step_time` seconds, up to `max_users`."""
    return min(max_users, step_users * (int(t // step_time) + 1))


def spike_users(t: float, base: int, peak: int, start: float, length: float) -> int:
    """Users at time t: `base`, then `peak` during [start, start + length), then `base` again."""
    return peak if start <= t < start + length else base


@dataclass(frozen=True)
class LoadMode:
    """How the runner paces requests.

    concurrency only: that many requests always in flight. rate: requests start on the arrival schedule,
    at most `concurrency` at once when it is set. trace: each request at its own send offset (a trace replay),
    at most `concurrency` at once when it is set.
    """

    concurrency: int | None = None
    rate: float | None = None
    arrival: ArrivalKind = "poisson"
    burstiness: float = 1.0
    trace: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.concurrency is None and self.rate is None and not self.trace:
            raise ValueError("give a concurrency, a request rate, or a trace schedule")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")

    @property
    def label(self) -> str:
        """A name for the run, as AIPerf names its artifact folders."""
        if self.trace:
            return "fixed_schedule" + (f"-concurrency{self.concurrency}" if self.concurrency else "")
        if self.rate is not None:
            return f"request_rate{self.rate:g}-{self.arrival}" + (
                f"-concurrency{self.concurrency}" if self.concurrency else "")
        return f"concurrency{self.concurrency}"
