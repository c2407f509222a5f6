"""Scale engine replicas on what the engines feel: their waiting queues and KV cache usage.

A replica whose KV cache is full preempts and stalls long before its request count says so, and one with a long
waiting queue misses its time-to-first-token. So this policy scales up when the waiting requests per replica, the
KV usage or the preemption rate passes its high mark, and scales down only when waiting and KV usage are both
under their low marks and, spread over one replica fewer, would stay under the middle of their bands (a scale-in
that lands next to a high mark comes straight back), and have done so for a cooldown: a request's KV grows as it
generates, so a load that looks small at one moment (requests that all started together) needs every replica a
few seconds later. Between the marks it holds.

`queue_kv_decision` is a pure function of `DeploymentSignals`, a `QueueKVConfig` and the state it returned last
time; `QueueKVPolicy` adapts it to Ray Serve (`AutoscalingConfig(policy={"policy_function":
"autoscaling.policy:QueueKVPolicy", "policy_kwargs": {...}})`). Serve then applies its own delays, scaling
factors and min/max bounds to the count returned, as it does for any policy.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from autoscaling.signals import DeploymentSignals, replica_signals

# Serve's own logger: under Serve the decisions land in the controller's log beside its scaling lines.
log = logging.getLogger("ray.serve")

STATE_KEY = "tokenline_queue_kv"  # this policy's entry in Serve's policy_state


@dataclass(frozen=True)
class QueueKVConfig:
    """The policy's thresholds. Per-replica values are means over the replicas that reported."""

    __pydantic_config__ = {"extra": "forbid"}  # AppArgs validates this record as its `autoscaling.queue_kv`

    # Waiting requests per replica above which it scales up: a queue this long is TTFT the engine cannot hide.
    waiting_high: float = 2.0
    # ... and below which (with KV usage under kv_low) it may scale down.
    waiting_low: float = 0.5
    # KV usage above which it scales up: past it, new requests wait for blocks and running ones get preempted.
    kv_high: float = 0.85
    # ... and below which (with the queue under waiting_low) it may scale down.
    kv_low: float = 0.5
    # Preemptions per second per replica that count as overload whatever the usage (the pool is thrashing).
    preemptions_high: float = 0.5
    # Most replicas added in one decision (the step grows with how far past the high mark the load is).
    max_step_up: int = 2
    # Most replicas removed in one decision.
    max_step_down: int = 1
    # No scale-down for this long after the load last needed every replica: past a high mark, near one on one
    # replica fewer, or waiting for replicas still starting. Replicas added for an overload must first drain the
    # backlog that made them, and the KV of running requests grows until they finish, so the load must fit on fewer
    # replicas for a while, not a moment.
    scale_down_cooldown_s: float = 60.0
    # Before any replica has reported its engine stats: Serve's rule (ongoing / target) with this target,
    # and only ever up.
    fallback_target_ongoing: float = 32.0

    def __post_init__(self) -> None:
        if not 0 <= self.waiting_low < self.waiting_high:
            raise ValueError(f"need 0 <= waiting_low < waiting_high; got {self.waiting_low}, {self.waiting_high}")
        if not 0 <= self.kv_low < self.kv_high <= 1:
            raise ValueError(f"need 0 <= kv_low < kv_high <= 1; got {self.kv_low}, {self.kv_high}")
        if self.preemptions_high <= 0 or self.fallback_target_ongoing <= 0:
            raise ValueError("preemptions_high and fallback_target_ongoing must be positive")
        if self.max_step_up < 1 or self.max_step_down < 1:
            raise ValueError(f"max_step_up and max_step_down must be >= 1; got {self.max_step_up}, "
                             f"{self.max_step_down}")
        if self.scale_down_cooldown_s < 0:
            raise ValueError(f"scale_down_cooldown_s must be >= 0; got {self.scale_down_cooldown_s}")


@dataclass(frozen=True)
class Load:
    """The deployment's load, per replica, as the policy reads it."""

    waiting: float  # engine queues plus requests queued in Serve's handles, per replica
    kv_usage: float
    preemptions_per_s: float

    def pressure(self, config: QueueKVConfig) -> float:
        """How far past its high mark the most loaded signal is: above 1 means overloaded."""
        return max(self.waiting / config.waiting_high, self.kv_usage / config.kv_high,
                   self.preemptions_per_s / config.preemptions_high)


@dataclass(frozen=True)
class Decision:
    num_replicas: int
    reason: str
    state: dict[str, Any] = field(default_factory=dict)


def measured_load(signals: DeploymentSignals) -> Load | None:
    """Means over the replicas that reported; None when none has. Requests Serve queues in its handles (ongoing
    beyond what the engines hold) count as waiting, but only when every replica reported, so an unreported
    replica's requests are not mistaken for a queue."""
    reported = signals.reported
    if not reported:
        return None
    waiting = sum(r.num_waiting for r in reported)
    if signals.all_reported:
        waiting += max(0.0, signals.total_ongoing - sum(r.num_waiting + r.num_running for r in reported))
    n = len(reported)
    return Load(waiting=waiting / n, kv_usage=sum(r.kv_usage for r in reported) / n,
                preemptions_per_s=sum(r.preemptions_per_s for r in reported) / n)


def queue_kv_decision(signals: DeploymentSignals, config: QueueKVConfig, state: dict[str, Any]) -> Decision:
    """The replica count this policy wants, within [min_replicas, max_replicas], and its new state."""
    state = dict(state)
    n, target = signals.current_replicas, signals.target_replicas
    low, high = signals.min_replicas, signals.max_replicas

    def decide(num: int, reason: str) -> Decision:
        return Decision(min(max(num, low), high), reason, state)

    if n == 0:
        return decide(target, "no running replica")
    load = measured_load(signals)
    if load is None:
        wanted = math.ceil(signals.total_ongoing / config.fallback_target_ongoing)
        if wanted > target:
            state["last_needed_at"] = signals.now
            return decide(wanted, f"no engine stats yet; {signals.total_ongoing:.0f} ongoing requests")
        return decide(target, "no engine stats yet")

    pressure = load.pressure(config)
    if pressure > 1:
        state["last_needed_at"] = signals.now
        # Replicas still starting will take their share: size the step on the count Serve is already moving to.
        base = max(n, target)
        excess = pressure * n / base - 1
        if excess <= 0:
            return decide(target, f"overloaded, replicas starting ({_describe(load)})")
        step = min(max(math.ceil(base * excess), 1), config.max_step_up)
        return decide(base + step, f"overloaded ({_describe(load)})")

    if target > n:
        # The load that asked for them is still here: the cooldown starts once they run.
        state["last_needed_at"] = signals.now
        return decide(target, "replicas starting")
    fewer = _fits_on(load, n, low, config)
    if fewer == n and n > max(low, 1):
        state["last_needed_at"] = signals.now
    if load.waiting > config.waiting_low or load.kv_usage > config.kv_low:
        return decide(target, f"within marks ({_describe(load)})")
    if n <= low:
        return decide(target, "under the low marks, at min_replicas")
    if not signals.all_reported:
        return decide(target, "under the low marks, but not every replica has reported")
    if fewer == n:
        return decide(target, f"under the low marks, but on {n - 1} replicas the load would near the high marks")
    last_needed = state.get("last_needed_at")
    if last_needed is not None and signals.now - last_needed < config.scale_down_cooldown_s:
        return decide(target, f"under the low marks, cooling down: the load needed {n} replicas "
                              f"{signals.now - last_needed:.0f}s ago")
    return decide(min(fewer, target), f"under the low marks ({_describe(load)})")


def _fits_on(load: Load, n: int, low: int, config: QueueKVConfig) -> int:
    """The fewest replicas (at least n - max_step_down, min_replicas and 1) the load fits on: moved onto them, it
    stays under the middle of each band. Averages hide peaks (a request's KV grows as it generates), hence the
    margin below the high marks."""
    fewer = n
    while fewer > max(low, 1) and n - fewer < config.max_step_down:
        spread = n / (fewer - 1)
        if (load.waiting * spread >= (config.waiting_low + config.waiting_high) / 2
                or load.kv_usage * spread >= (config.kv_low + config.kv_high) / 2
                or load.preemptions_per_s * spread >= config.preemptions_high / 2):
            break
        fewer -= 1
    return fewer


def _describe(load: Load) -> str:
    return (f"waiting/replica {load.waiting:.2f}, KV {load.kv_usage:.0%}, "
            f"preemptions/s/replica {load.preemptions_per_s:.2f}")


def signals_from_context(ctx: Any) -> DeploymentSignals:
    """DeploymentSignals from Ray Serve's AutoscalingContext (read by attribute; nothing of Ray is imported)."""
    metrics = ctx.aggregated_metrics or {}
    replicas = []
    for replica_id in ctx.running_replicas:
        values = {name: by_replica[replica_id] for name, by_replica in metrics.items() if replica_id in by_replica}
        replicas.append(replica_signals(values))
    now = ctx.current_time if ctx.current_time is not None else time.time()
    config = ctx.config
    return DeploymentSignals(current_replicas=ctx.current_num_replicas, target_replicas=ctx.target_num_replicas,
                             min_replicas=ctx.capacity_adjusted_min_replicas,
                             max_replicas=ctx.capacity_adjusted_max_replicas,
                             total_ongoing=float(ctx.total_num_requests or 0.0), replicas=tuple(replicas), now=now,
                             upscale_delay_s=config.upscale_delay_s, look_back_period_s=config.look_back_period_s,
                             metrics_interval_s=config.metrics_interval_s)


class ServePolicy:
    """Ray Serve's custom autoscaling policy hook: Serve builds it once with `policy_kwargs` (the fields of the
    policy's config) and calls it every control-loop tick with an AutoscalingContext; it returns (replicas,
    policy_state). Its own state lives in `policy_state` under `state_key`, so a rebuilt policy carries on where
    the last one stopped. A policy is its config type, its pure decision function and its state key."""

    config_type: type
    state_key: str

    def __init__(self, **policy_kwargs: Any) -> None:
        self.config = self.config_type(**policy_kwargs)
        self._last_logged: tuple[int, int] | None = None  # (target, decision): logged once, not every tick

    @staticmethod
    def decide(signals: DeploymentSignals, config: Any, state: dict[str, Any]) -> Decision:
        raise NotImplementedError

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        signals = signals_from_context(ctx)
        previous = dict(ctx.policy_state.get(self.state_key) or {})
        decision = self.decide(signals, self.config, previous)
        wish = (signals.target_replicas, decision.num_replicas)
        if decision.num_replicas != signals.target_replicas and wish != self._last_logged:
            log.info("%s: %d -> %d replicas: %s", ctx.deployment_name, signals.target_replicas,
                     decision.num_replicas, decision.reason)
        self._last_logged = wish
        return decision.num_replicas, {self.state_key: decision.state}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({asdict(self.config)})"


class QueueKVPolicy(ServePolicy):
    """`"policy_function": "autoscaling.policy:QueueKVPolicy"`, `policy_kwargs`: the QueueKVConfig fields."""

    config_type = QueueKVConfig
    state_key = STATE_KEY
    decide = staticmethod(queue_kv_decision)
