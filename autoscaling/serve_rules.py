"""Ray Serve's own autoscaling rules, restated as pure functions so the simulator can run them offline.

Sources (Ray 2.60): `ray/serve/autoscaling_policy.py` — `_core_replica_queue_length_policy` (the default policy),
`_apply_scaling_factors`, `_apply_delay_logic` and `_apply_autoscaling_config` (which wraps every policy, custom
ones included); the min/max bounds are `DeploymentAutoscalingState.apply_bounds` in
`ray/serve/_private/autoscaling_state.py`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from autoscaling.signals import DeploymentSignals

DEFAULT_TARGET_ONGOING_REQUESTS = 2.0  # ray.serve._private.constants.DEFAULT_TARGET_ONGOING_REQUESTS


@dataclass(frozen=True)
class ServeAutoscalingConfig:
    """The AutoscalingConfig fields Serve applies around a policy's answer."""

    min_replicas: int = 1
    max_replicas: int = 1
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    downscale_to_zero_delay_s: float | None = None  # 1 -> 0 waits this long (None: downscale_delay_s)
    upscaling_factor: float = 1.0
    downscaling_factor: float = 1.0
    look_back_period_s: float = 30.0
    metrics_interval_s: float = 10.0


def ongoing_requests_decision(signals: DeploymentSignals, target_ongoing_requests: float) -> float:
    """Serve's default policy: as many replicas as keep `target_ongoing_requests` ongoing requests on each.

    `_core_replica_queue_length_policy`: desired = current * (total / (target * current)), i.e. total / target,
    a float that the scaling factors and `math.ceil` turn into a count.
    """
    if signals.current_replicas == 0:
        return float(signals.target_replicas)
    return signals.total_ongoing / target_ongoing_requests


def apply_scaling_factors(desired: float, current: int, config: ServeAutoscalingConfig) -> int:
    """`_apply_scaling_factors`: move a factor of the way from current to desired, never stuck one short."""
    if current == 0:
        return math.ceil(desired)
    delta = desired - current
    factor = config.upscaling_factor if delta > 0 else config.downscaling_factor
    scaled = math.ceil(current + factor * delta)
    if math.ceil(desired) < current and scaled == current:
        scaled -= 1
    return scaled


def apply_delays(desired: int, target: int, config: ServeAutoscalingConfig, state: dict[str, Any],
                 now: float) -> tuple[int, dict[str, Any]]:
    """`_apply_delay_logic`: a change happens once the policy has wanted that direction for the whole delay."""
    direction = state.get("direction", 0)
    since = state.get("since")
    decision = target
    if desired > target:
        if direction < 0:
            since = None
        direction = 1
        since = now if since is None else since
        if now - since + 1e-6 >= config.upscale_delay_s:
            decision, direction, since = desired, 0, None
    elif desired < target:
        if direction > 0:
            since = None
        direction = -1
        since = now if since is None else since
        to_zero = target == 1 and config.downscale_to_zero_delay_s is not None
        delay = config.downscale_to_zero_delay_s if to_zero else config.downscale_delay_s
        if now - since + 1e-6 >= delay:
            decision, direction, since = max(1, desired) if target > 1 else desired, 0, None
    else:
        direction, since = 0, None
    return decision, {**state, "direction": direction, "since": since}


def cold_start_replicas(signals: DeploymentSignals, config: ServeAutoscalingConfig) -> int | None:
    """`_get_cold_start_scale_up_replicas`: at zero replicas with requests waiting, Serve asks for one at once,
    without asking the policy."""
    if signals.current_replicas == 0 and signals.total_ongoing > 0:
        return max(math.ceil(config.upscaling_factor), signals.target_replicas)
    return None


def apply_serve(desired: float, signals: DeploymentSignals, config: ServeAutoscalingConfig,
                state: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """What Serve makes of a policy's answer: scaling factors, then delays, then the min/max bounds."""
    cold = cold_start_replicas(signals, config)
    if cold is not None:
        return min(max(cold, config.min_replicas), config.max_replicas), state
    scaled = apply_scaling_factors(desired, signals.current_replicas, config)
    if signals.current_replicas == 0 and scaled > 0:  # Serve skips the delay when scaling from zero
        return min(max(scaled, config.min_replicas), config.max_replicas), state
    decision, state = apply_delays(max(0, scaled), signals.target_replicas, config, state, signals.now)
    return min(max(decision, config.min_replicas), config.max_replicas), state
