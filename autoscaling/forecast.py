"""Holt's linear trend, in continuous time: a level and a slope, smoothed over time constants in seconds.

Without a trend time constant it is simple exponential smoothing (the slope stays 0).

Serve calls a policy every control-loop tick, and the simulator every `control_interval_s`: the updates come at
uneven intervals, so each one weighs the new value by `1 - exp(-dt / level_time_s)` (and the slope by
`1 - exp(-dt / trend_time_s)`) rather than by a fixed alpha and beta per sample.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class HoltState:
    level: float
    trend: float  # per second
    at: float  # time of the last update


@dataclass(frozen=True)
class Holt:
    level_time_s: float
    trend_time_s: float | None

    def __post_init__(self) -> None:
        if self.level_time_s <= 0 or (self.trend_time_s is not None and self.trend_time_s <= 0):
            raise ValueError(f"Holt's time constants must be positive; got {self.level_time_s}, "
                             f"{self.trend_time_s}")

    def update(self, state: HoltState | None, value: float, now: float) -> HoltState:
        if state is None:
            return HoltState(value, 0.0, now)
        dt = now - state.at
        if dt <= 0:
            return state
        predicted = state.level + state.trend * dt
        level = predicted + (1 - math.exp(-dt / self.level_time_s)) * (value - predicted)
        if self.trend_time_s is None:
            return HoltState(level, 0.0, now)
        slope = (level - state.level) / dt
        trend = state.trend + (1 - math.exp(-dt / self.trend_time_s)) * (slope - state.trend)
        return HoltState(level, trend, now)

    @staticmethod
    def forecast(state: HoltState, horizon_s: float) -> float:
        return max(0.0, state.level + state.trend * horizon_s)
