"""The queue + KV replica-count policy, decision by decision, and Serve's own rules as the simulator restates them."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from autoscaling.policy import STATE_KEY, QueueKVConfig, QueueKVPolicy, queue_kv_decision
from autoscaling.serve_rules import ServeAutoscalingConfig, apply_serve, ongoing_requests_decision
from autoscaling.signals import DeploymentSignals, ReplicaSignals

CONFIG = QueueKVConfig(waiting_high=2.0, waiting_low=0.5, kv_high=0.85, kv_low=0.5, preemptions_high=0.5,
                       max_step_up=2, max_step_down=1, scale_down_cooldown_s=60.0, fallback_target_ongoing=32.0)
IDLE = ReplicaSignals(kv_usage=0.0, num_waiting=0, num_running=0)


def replica(kv: float = 0.3, waiting: float = 0.0, running: float = 4.0, preemptions: float = 0.0) -> ReplicaSignals:
    return ReplicaSignals(kv_usage=kv, num_waiting=waiting, num_running=running, preemptions_per_s=preemptions)


def signals(replicas, target: int | None = None, ongoing: float | None = None, low: int = 1, high: int = 8,
            now: float = 1000.0) -> DeploymentSignals:
    replicas = tuple(replicas)
    if ongoing is None:
        ongoing = sum(r.num_running + r.num_waiting for r in replicas if r is not None)
    return DeploymentSignals(current_replicas=len(replicas), target_replicas=len(replicas) if target is None
                             else target, min_replicas=low, max_replicas=high, total_ongoing=ongoing,
                             replicas=replicas, now=now)


@dataclass
class Case:
    name: str
    signals: DeploymentSignals
    expected: int
    state: dict = field(default_factory=dict)
    reason: str = ""


CASES = [
    # scale up on each signal past its high mark
    Case("waiting past its high mark", signals([replica(waiting=3)] * 2), 3, reason="overloaded"),
    Case("KV usage past its high mark, no queue", signals([replica(kv=0.95)] * 2), 3, reason="overloaded"),
    Case("preemptions past their high mark", signals([replica(kv=0.8, preemptions=1.0)] * 2), 4),
    Case("the step grows with the excess, bounded by max_step_up", signals([replica(waiting=20)] * 2), 4),
    Case("one overloaded replica of four is not enough on average",
         signals([replica(waiting=6)] + [replica()] * 3), 4, reason="within marks"),
    Case("requests queued in Serve's handles count as waiting",
         signals([replica(running=10)] * 2, ongoing=2 * 10 + 6), 3, reason="overloaded"),
    # hold between the marks (hysteresis)
    Case("waiting between the marks holds", signals([replica(waiting=1.0)] * 3), 3, reason="within marks"),
    Case("KV between the marks holds", signals([replica(kv=0.7)] * 3), 3, reason="within marks"),
    Case("low queue but KV above its low mark holds", signals([replica(kv=0.6, waiting=0)] * 3), 3),
    Case("low KV but queue above its low mark holds", signals([replica(kv=0.1, waiting=1)] * 3), 3),
    # scale down only when both are under their low marks and n - 1 replicas stay under the middle of the bands
    Case("both under their low marks: one step down", signals([replica(kv=0.3, waiting=0.2)] * 4), 3,
         reason="under the low marks"),
    Case("under the low marks, but 1 replica would pass KV's high mark", signals([replica(kv=0.45)] * 2), 2,
         reason="would near the high marks"),
    Case("under the low marks, but 1 replica would be past the middle of KV's band", signals([replica(kv=0.4)] * 2),
         2, reason="would near the high marks"),
    Case("under the low marks, and 1 replica would stay in the lower half of the bands",
         signals([replica(kv=0.3, waiting=0.3)] * 2), 1, reason="under the low marks"),
    Case("all idle: one step down", signals([IDLE] * 3, ongoing=0), 2),
    Case("all idle at min_replicas stays", signals([IDLE] * 2, ongoing=0, low=2), 2),
    Case("no scale-down within the cooldown after an overload", signals([IDLE] * 3, now=1030.0), 3,
         state={"last_needed_at": 1000.0}, reason="cooling down"),
    Case("scale-down once the cooldown has passed", signals([IDLE] * 3, now=1061.0), 2,
         state={"last_needed_at": 1000.0}),
    Case("no scale-down within the cooldown after the load last needed every replica",
         signals([replica(kv=0.3, waiting=0.3)] * 2, now=1030.0), 2, state={"last_needed_at": 1000.0},
         reason="cooling down: the load needed 2 replicas 30s ago"),
    # bounds
    Case("never above max_replicas", signals([replica(waiting=20)] * 3, high=4), 4),
    Case("at max_replicas stays", signals([replica(waiting=20)] * 4, high=4), 4),
    Case("below min_replicas is lifted", signals([IDLE] * 1, low=2), 2),
    # replicas starting or not reported yet
    Case("a replica that has not reported blocks a scale-down", signals([IDLE, IDLE, None], ongoing=0), 3,
         reason="not every replica has reported"),
    Case("reported replicas past the high mark still scale up", signals([replica(waiting=5), None]), 4),
    Case("no replica reported: Serve's rule on ongoing requests, up only", signals([None, None], ongoing=100), 4,
         reason="no engine stats yet"),
    Case("no replica reported and little load: hold", signals([None, None], ongoing=3), 2,
         reason="no engine stats yet"),
    Case("replicas starting absorb the overload", signals([replica(waiting=3)] * 2, target=3), 3,
         reason="replicas starting"),
    Case("replicas starting are never cancelled by a low load", signals([IDLE] * 2, target=4), 4,
         reason="replicas starting"),
    Case("overload beyond what the starting replicas absorb", signals([replica(waiting=12)] * 2, target=3), 5),
    Case("no running replica: hold the target", signals([], target=2, ongoing=5), 2),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_queue_kv_decision(case: Case):
    decision = queue_kv_decision(case.signals, CONFIG, case.state)
    assert decision.num_replicas == case.expected, decision.reason
    assert case.reason in decision.reason


def test_overload_and_replicas_starting_are_remembered_and_the_callers_state_is_left_alone():
    state = {"last_needed_at": 10.0}
    decision = queue_kv_decision(signals([replica(waiting=5)] * 2, now=500.0), CONFIG, state)
    assert decision.state["last_needed_at"] == 500.0
    assert state == {"last_needed_at": 10.0}
    starting = queue_kv_decision(signals([replica(waiting=2.5)] * 2, target=3, now=600.0), CONFIG, decision.state)
    assert starting.num_replicas == 3 and starting.state["last_needed_at"] == 600.0
    # Once the overload is gone, replicas still starting keep the cooldown from beginning.
    waiting_for_them = queue_kv_decision(signals([IDLE] * 2, target=3, now=700.0), CONFIG, starting.state)
    assert waiting_for_them.num_replicas == 3 and waiting_for_them.state["last_needed_at"] == 700.0


def test_a_load_that_needs_every_replica_restarts_the_cooldown_without_an_overload():
    state: dict = {}
    needed = queue_kv_decision(signals([replica(kv=0.45)] * 2, now=500.0), CONFIG, state)
    assert needed.num_replicas == 2 and needed.state["last_needed_at"] == 500.0
    # At min_replicas no scale-in is possible: nothing to remember.
    at_min = queue_kv_decision(signals([replica(kv=0.45)] * 2, low=2, now=510.0), CONFIG, needed.state)
    assert at_min.state["last_needed_at"] == 500.0
    fits = queue_kv_decision(signals([replica(kv=0.2)] * 2, now=540.0), CONFIG, needed.state)
    assert fits.num_replicas == 2 and "cooling down" in fits.reason and fits.state["last_needed_at"] == 500.0
    assert queue_kv_decision(signals([replica(kv=0.2)] * 2, now=561.0), CONFIG, fits.state).num_replicas == 1


def test_waves_of_requests_that_start_together_never_scale_in_between_them():
    """32 closed-loop streams of ~100-token prompts and 128 output tokens over 2 replicas of 384 blocks of 16: each
    wave starts at 7 blocks a request (KV 29%, one replica could take it at that moment) and ends at 15 (62%).
    Sampled every second from the overload that added the second replica, with a 10 s cooldown: the low moments
    never last long enough for a scale-in."""
    config = QueueKVConfig(scale_down_cooldown_s=10.0)
    state: dict = {"last_needed_at": -1.0}
    wave_s, blocks = 12, 2 * 384
    for t in range(120):
        kv = 32 * (7 + 8 * (t % wave_s) / wave_s) / blocks
        decision = queue_kv_decision(signals([replica(kv=kv, running=16)] * 2, now=float(t)), config, state)
        assert decision.num_replicas == 2, (t, kv, decision.reason)
        state = decision.state


def test_a_ramp_up_and_down_with_hysteresis_never_flaps():
    """Load per replica climbs past the high mark, then falls back through the band: up once, then down only
    after the low marks and the cooldown."""
    state: dict = {}
    n, counts = 2, []
    for t, total_waiting in enumerate([0, 2, 5, 8, 8, 5, 3, 2, 1, 0.5, 0, 0, 0, 0, 0, 0]):
        now = t * 30.0
        per_replica = replica(kv=min(1.0, 0.1 + total_waiting / 10), waiting=total_waiting / n)
        decision = queue_kv_decision(signals([per_replica] * n, now=now), CONFIG, state)
        n, state = decision.num_replicas, decision.state
        counts.append(n)
    ups = sum(1 for a, b in zip(counts, counts[1:]) if b > a)
    downs = [i for i, (a, b) in enumerate(zip(counts, counts[1:])) if b < a]
    assert max(counts) > 2 and counts[-1] < max(counts)
    assert ups >= 1 and all(i > counts.index(max(counts)) for i in downs), counts
    changes = [b - a for a, b in zip(counts, counts[1:]) if b != a]
    assert all(c > 0 for c in changes[:ups]) and all(c < 0 for c in changes[ups:]), counts


@pytest.mark.parametrize("kwargs", [{"waiting_low": 3.0, "waiting_high": 2.0}, {"kv_high": 1.5},
                                    {"kv_low": 0.9, "kv_high": 0.85}, {"max_step_up": 0},
                                    {"scale_down_cooldown_s": -1}, {"preemptions_high": 0}])
def test_inconsistent_thresholds_are_refused(kwargs):
    with pytest.raises(ValueError):
        QueueKVConfig(**kwargs)


def serve_context(metrics: dict[str, dict[str, float]], running: list[str], target: int, ongoing: float,
                  state: dict | None = None) -> SimpleNamespace:
    """The AutoscalingContext attributes the adapter reads, shaped as Ray 2.60 fills them."""
    return SimpleNamespace(deployment_name="EngineReplica", aggregated_metrics=metrics, running_replicas=running,
                           current_num_replicas=len(running), target_num_replicas=target,
                           capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4,
                           total_num_requests=ongoing, policy_state=state or {}, current_time=100.0,
                           config=SimpleNamespace(upscale_delay_s=10.0, look_back_period_s=10.0,
                                                  metrics_interval_s=1.0))


def test_serve_adapter_reads_aggregated_metrics_per_replica_and_keeps_its_state_under_its_key():
    policy = QueueKVPolicy(**{"waiting_high": 2.0, "kv_high": 0.85})
    metrics = {"kv_usage": {"a": 0.9, "b": 0.95}, "num_waiting": {"a": 1.0, "b": 2.0},
               "num_running": {"a": 8.0, "b": 8.0}}
    replicas, state = policy(serve_context(metrics, ["a", "b"], target=2, ongoing=19.0))
    assert replicas == 3
    assert state == {STATE_KEY: {"last_needed_at": 100.0}}
    # A replica missing from aggregated_metrics (not reported yet) blocks a scale-down.
    idle = {"kv_usage": {"a": 0.0}, "num_waiting": {"a": 0.0}, "num_running": {"a": 0.0}}
    replicas, _ = policy(serve_context(idle, ["a", "b"], target=2, ongoing=0.0))
    assert replicas == 2
    replicas, _ = policy(serve_context({}, ["a", "b"], target=2, ongoing=0.0))
    assert replicas == 2


def test_serve_adapter_logs_a_wanted_change_once_not_on_every_tick(caplog):
    policy = QueueKVPolicy(**{"waiting_high": 2.0, "kv_high": 0.85})
    busy = {"kv_usage": {"a": 0.7}, "num_waiting": {"a": 2.5}, "num_running": {"a": 8.0}}
    steady = {"kv_usage": {"a": 0.6}, "num_waiting": {"a": 1.0}, "num_running": {"a": 8.0}}
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        for _ in range(10):  # Serve's target stays at 1 for its upscale delay: the policy keeps wanting 2
            assert policy(serve_context(busy, ["a"], target=1, ongoing=10.5))[0] == 2
        assert len(caplog.records) == 1 and "1 -> 2 replicas" in caplog.records[0].getMessage()
        policy(serve_context(steady, ["a"], target=1, ongoing=9.0))  # holds: nothing to log
        policy(serve_context(busy, ["a"], target=1, ongoing=10.5))  # wants 2 again: a new decision
    assert len(caplog.records) == 2


def test_serve_default_rule_is_ongoing_over_target():
    assert ongoing_requests_decision(signals([IDLE] * 3, ongoing=10), 2.0) == 5.0
    assert ongoing_requests_decision(signals([], target=2, ongoing=10), 2.0) == 2.0


@pytest.mark.parametrize("desired,target,elapsed,expected", [
    (5, 2, 0.0, 2),  # wanting more starts the upscale clock
    (4, 2, 10.0, 4),  # ... and acts once the delay has passed
    (1, 3, 10.0, 3),  # wanting fewer waits for the (longer) downscale delay
    (1, 3, 60.0, 1),
    (9, 3, 10.0, 4),  # max_replicas bounds the result
])
def test_serve_delays_and_bounds(desired, target, elapsed, expected):
    config = ServeAutoscalingConfig(min_replicas=1, max_replicas=4, upscale_delay_s=10.0, downscale_delay_s=60.0)
    state: dict = {}
    base = signals([IDLE] * target, now=0.0)
    _, state = apply_serve(desired, base, config, state)
    later = signals([IDLE] * target, now=elapsed)
    decision, _ = apply_serve(desired, later, config, state)
    assert decision == expected
