"""What an engine replica reports to the SLO policy: its capacity at the SLO and the load it is offered.

The engine replica (deployments/engine_replica.py) and the simulated one (autoscaling/replica.py) feed the same
object, the one with the engine's steps, the other with its simulated ones, so both report alike.
"""
from __future__ import annotations

from autoscaling.capacity import SLO, Capacity, CapacityModel, StepStats, StepWindow
from autoscaling.demand import DemandMeter
from autoscaling.signals import (ARRIVALS_PER_S, CAPACITY_ALONE_TOKENS_PER_S, CAPACITY_TOKENS_PER_S,
                                DEMAND_TOKENS_PER_S, STEP_CORRECTION)
from autoscaling.step_model import ReplicaProfile

REFRESH_S = 2.0  # the capacity is solved again at most this often (a few ms of numpy each time)


class ReplicaLoad:
    def __init__(self, profile: ReplicaProfile, slo: SLO) -> None:
        self.model = CapacityModel(profile, slo)
        self.steps = StepWindow(self.model)
        self.demand = DemandMeter(self.model.prior)
        self._capacity: Capacity | None = None
        self._solved_at = float("-inf")

    def arrived(self, now: float, prompt_tokens: int, max_tokens: int) -> None:
        self.demand.arrived(now, prompt_tokens, max_tokens)

    def finished(self, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> None:
        self.demand.finished(prompt_tokens, cached_tokens, output_tokens)

    def add_steps(self, steps: list[StepStats]) -> None:
        self.steps.add_new(steps)

    def capacity(self, now: float) -> Capacity:
        if self._capacity is None or now - self._solved_at >= REFRESH_S:
            self._capacity = self.model.capacity(self.demand.sizes(), self.steps.correction(now))
            self._solved_at = now
        return self._capacity

    def metrics(self, now: float) -> dict[str, float]:
        demand = self.demand.demand(now)
        capacity = self.capacity(now)
        return {CAPACITY_TOKENS_PER_S: capacity.tokens_per_s, CAPACITY_ALONE_TOKENS_PER_S: capacity.alone_tokens_per_s,
                DEMAND_TOKENS_PER_S: demand.tokens_per_s,
                ARRIVALS_PER_S: demand.arrivals_per_s, STEP_CORRECTION: capacity.correction}
