"""The load a replica is offered: requests arriving, and the tokens of work they bring.

A request's work is its prompt tokens the prefix cache will not serve plus the tokens it will generate. Neither
is known when it arrives, so each is estimated from the requests that finished lately: the share of prompt tokens
they found cached, and how many tokens they generated (capped by the new request's own `max_tokens`). Before any
has finished, the estimate comes from the prior (the replica profile's held-out workload).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from autoscaling.capacity import RequestSizes

DEMAND_WINDOW_S = 10.0  # arrivals are counted over this window; Serve then averages over its look-back
FINISHED_HISTORY = 512  # the recent requests whose sizes stand for the next ones (tails need several hundred)


@dataclass(frozen=True)
class Demand:
    arrivals_per_s: float
    tokens_per_s: float  # tokens of work arriving per second: uncached prompt tokens plus expected output


class DemandMeter:
    def __init__(self, prior: RequestSizes, window_s: float = DEMAND_WINDOW_S) -> None:
        self.window_s = window_s
        self.prior = prior
        self._arrivals: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens, max tokens)
        self._finished: deque[tuple[int, int, int]] = deque(maxlen=FINISHED_HISTORY)  # (prompt, cached, output)
        self._sizes: RequestSizes | None = None
        self._started_at: float | None = None

    def arrived(self, now: float, prompt_tokens: int, max_tokens: int) -> None:
        self._started_at = now if self._started_at is None else self._started_at
        self._arrivals.append((now, prompt_tokens, max_tokens))

    def finished(self, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> None:
        self._finished.append((prompt_tokens, cached_tokens, output_tokens))
        self._sizes = None

    def sizes(self) -> RequestSizes:
        """The recent finished requests' sizes, or the prior's before any has finished."""
        if self._sizes is None:
            if not self._finished:
                return self.prior
            rows = np.array(self._finished, dtype=float)
            self._sizes = RequestSizes(rows[:, 0], rows[:, 1], rows[:, 2])
        return self._sizes

    def demand(self, now: float) -> Demand:
        while self._arrivals and self._arrivals[0][0] < now - self.window_s:
            self._arrivals.popleft()
        if not self._arrivals:
            return Demand(0.0, 0.0)
        sizes = self.sizes()
        output = float(np.mean(sizes.output))
        cached_share = float(np.sum(sizes.cached) / max(np.sum(sizes.prompt), 1.0))
        tokens = sum(prompt * (1 - cached_share) + min(max_tokens, output) for _, prompt, max_tokens in self._arrivals)
        # A replica younger than the window has seen arrivals for less than the window.
        span = max(1.0, min(self.window_s, now - self._started_at))
        return Demand(len(self._arrivals) / span, tokens / span)
