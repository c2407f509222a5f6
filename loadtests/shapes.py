"""Locust load shapes: a staircase and a spike, configured with the --step-* and --spike-* options."""
from __future__ import annotations

from locust import LoadTestShape

from loadtests.arrivals import spike_users, step_users


class StepLoadShape(LoadTestShape):
    abstract = True  # made concrete in shape_step.py, so that importing it here selects nothing

    def tick(self) -> tuple[int, float] | None:
        o = self.runner.environment.parsed_options
        t = self.get_run_time()
        if t >= o.shape_duration:
            return None
        return step_users(t, o.step_users, o.step_time, o.step_max_users), float(max(o.step_users, 1))


class SpikeLoadShape(LoadTestShape):
    abstract = True  # made concrete in shape_spike.py

    def tick(self) -> tuple[int, float] | None:
        o = self.runner.environment.parsed_options
        t = self.get_run_time()
        if t >= o.shape_duration:
            return None
        users = spike_users(t, o.spike_base_users, o.spike_users, o.spike_start, o.spike_length)
        return users, float(max(o.spike_users, 1))  # the spike arrives within about a second
