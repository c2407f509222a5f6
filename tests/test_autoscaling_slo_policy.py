"""The SLO policy, decision by decision, its Ray Serve adapter and settings, and the policy in the simulator: ahead
of a surge, back after it, and from zero replicas."""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
from pydantic import ValidationError

from autoscaling.capacity import SLO, CapacityModel, RequestSizes
from autoscaling.serve_rules import ServeAutoscalingConfig
from autoscaling.signals import DeploymentSignals, ReplicaSignals
from autoscaling.simulator import ClusterConfig, SLOSimPolicy, simulate
from autoscaling.headroom import MIN_SAMPLES, SAMPLE_S, observed_surprise, prior_headroom
from autoscaling.slo_policy import STATE_KEY, SLOConfig, SLOPolicy, lead_time_s, slo_decision
from autoscaling.step_model import DEFAULT_PROFILE, ReplicaProfile
from autoscaling.workload import RequestSpec, ShapedWorkload
from deployments.autoscaling_config import AutoscalingArgs, engine_autoscaling_config
from tests.test_autoscaling_policy import signals as queue_kv_signals

FIXED = SLOConfig(headroom=0.2)  # a stated headroom, so the cases below read in round numbers
CAPACITY = 500.0  # tokens/s one replica sustains at the SLO beside others
ALONE = 400.0  # ... and alone


def replica(demand: float, arrivals: float | None = None, waiting: float = 0.0, kv: float = 0.3,
            running: float = 8.0) -> ReplicaSignals:
    return ReplicaSignals(kv_usage=kv, num_waiting=waiting, num_running=running, capacity_tokens_per_s=CAPACITY,
                          capacity_alone_tokens_per_s=ALONE, demand_tokens_per_s=demand,
                          arrivals_per_s=demand / 400 if arrivals is None else arrivals)


def signals(replicas, **kwargs) -> DeploymentSignals:
    """As the queue + KV policy's tests build them, with Serve's delays of AppArgs."""
    return dataclasses.replace(queue_kv_signals(replicas, **kwargs), upscale_delay_s=10.0, look_back_period_s=10.0,
                               metrics_interval_s=1.0)


WATCHED = {"reported_since": 0.0}  # the state of a policy whose replicas have reported since t = 0


def settled(load: list[ReplicaSignals], **kwargs) -> dict:
    """The policy's state after it has watched this load for ten minutes."""
    state: dict = {}
    for t in range(0, 600, 5):
        state = slo_decision(signals(load, now=float(t), **kwargs), FIXED, state).state
    return state


@pytest.mark.parametrize("demand,count,expected", [
    (100.0, 1, 1),  # under what one replica alone sustains, less the headroom (320)
    (500.0, 1, 2),  # past it: two, each beside the other
    (1500.0, 2, 4),  # 1500 / (500 * 0.8) = 3.75
    (5000.0, 4, 8),  # never past max_replicas
])
def test_asks_for_the_fewest_replicas_whose_capacity_less_the_headroom_covers_the_load(demand, count, expected):
    load = [replica(demand / count)] * count
    decision = slo_decision(signals(load, now=600.0), FIXED, settled(load))
    assert decision.num_replicas == max(expected, count)


def test_scales_in_only_when_fewer_replicas_still_cover_the_load():
    covered = [replica(700.0 / 3)] * 3  # 700 tok/s: two replicas cover 2 * 500 * (1 - 0.2) = 800
    assert slo_decision(signals(covered, now=600.0), FIXED, settled(covered)).num_replicas == 2
    tight = [replica(850.0 / 3)] * 3  # 850 > 800: three stay
    assert slo_decision(signals(tight, now=600.0), FIXED, settled(tight)).num_replicas == 3


def test_a_rising_load_is_planned_for_at_its_forecast_and_a_falling_one_at_its_recent_level():
    config = dataclasses.replace(FIXED, trend_time_s=60.0)
    state: dict = {}
    for t in range(0, 300, 5):  # 100 tok/s more every 10 s
        load = [replica((100.0 + 10.0 * t) / 2)] * 2
        decision = slo_decision(signals(load, now=float(t)), config, state)
        state = decision.state
    now_needs = (100.0 + 10.0 * 295) / (CAPACITY * 0.8)
    assert decision.num_replicas > now_needs  # asked for what the load will be one lead time on
    # The load halves at once: the policy keeps what the recent level needs until that level has come down.
    drop = [replica((100.0 + 10.0 * 295) / 4)] * 8
    assert slo_decision(signals(drop, now=300.0), FIXED, settled([replica(3000.0 / 8)] * 8)).num_replicas == 8


def test_queued_requests_ask_for_replicas_to_drain_them_within_the_lead_time():
    quiet = [replica(100.0)] * 2
    queued = [replica(100.0, waiting=20.0)] * 2
    base = slo_decision(signals(quiet, now=600.0), FIXED, settled(quiet)).num_replicas
    assert slo_decision(signals(queued, now=600.0), FIXED, settled(quiet)).num_replicas > base


def test_the_queue_and_kv_safety_net_scales_out_when_the_forecast_says_the_load_is_covered():
    full = [replica(100.0, kv=0.97)] * 2
    decision = slo_decision(signals(full, now=600.0), FIXED, settled([replica(100.0)] * 2))
    assert decision.num_replicas == 3 and "overloaded" in decision.reason
    # ... and blocks a scale-in for one lead time after.
    covered = [replica(50.0)] * 3
    state = dict(decision.state)
    assert slo_decision(signals(covered, now=610.0), FIXED, state).num_replicas == 3


def test_the_safety_net_waits_for_the_replicas_already_starting_but_still_blocks_a_scale_in():
    queued = [replica(100.0, waiting=40.0)] * 2  # 16 times the mark (what one replica gets through in 2 s)
    starting = slo_decision(signals(queued, target=3, now=600.0), FIXED, settled([replica(100.0)] * 2))
    # The plan drains the queue within a lead time: (200 + 80 * 400 / 31) / (500 * 0.8) -> 4 replicas. The queue
    # + KV rule alone would have asked for 5 on top of the one starting; the replicas starting take their share of
    # the queue before more are asked for.
    assert starting.num_replicas == 4 and "overloaded" not in starting.reason
    assert starting.state["last_overloaded_at"] == 600.0  # ... and a scale-in stays blocked
    # Arrived: for one look-back window (10 s) and a metrics push (1 s) the replicas' averages are of the time before
    # the new ones took their share, and the safety net does not read them as an overload.
    queued = [replica(100.0, waiting=80.0)] * 4
    arrived = slo_decision(signals(queued, now=630.0), FIXED, starting.state)
    assert arrived.state["arrived_at"] == 630.0 and arrived.state["last_overloaded_at"] == 600.0
    seen = slo_decision(signals(queued, now=640.0), FIXED, arrived.state)
    assert "overloaded" not in seen.reason and seen.state["last_overloaded_at"] == 600.0
    # Past it, with a queue the four cannot work off within a lead time (320 * 400 tokens against 1,600 tok/s spare
    # over 46 s): the safety net sees an overload again (the plan's drain asks for more still).
    still = slo_decision(signals(queued, now=641.5), FIXED, seen.state)
    assert still.num_replicas > 4 and still.state["last_overloaded_at"] == 641.5


def test_the_safety_net_leaves_a_queue_the_running_replicas_work_off_before_help_could_arrive():
    state = settled([replica(100.0)] * 4)
    # 6 waiting per replica is 2.4 times the mark, but 24 * 400 tokens go in 6 s at the 1,600 tok/s the four
    # have beyond the load: replicas asked for now would come when the queue is gone.
    drains = slo_decision(signals([replica(100.0, waiting=6.0)] * 4, now=600.0), FIXED, state)
    assert drains.num_replicas <= 4 and "overloaded" not in drains.reason
    # The same queue beside a load near their capacity (80 tok/s spare): overloaded.
    busy_state = settled([replica(480.0)] * 4)
    busy = slo_decision(signals([replica(480.0, waiting=6.0)] * 4, now=600.0), FIXED, busy_state)
    assert busy.num_replicas > 4 and "overloaded" in busy.reason
    # A full KV cache is overload however short the queue.
    full = slo_decision(signals([replica(100.0, waiting=6.0, kv=0.97)] * 4, now=600.0), FIXED, state)
    assert full.num_replicas > 4 and "overloaded" in full.reason


def test_a_scale_in_waits_while_the_load_on_its_trend_would_need_the_replicas():
    def ramp(config: SLOConfig) -> int:
        state: dict = {}
        for t in range(0, 305, 5):  # 280 -> 780 tok/s over 300 s on three replicas; two cover 800
            decision = slo_decision(signals([replica((280.0 + 500.0 * t / 300) / 3)] * 3, now=float(t)), config,
                                    state)
            state = decision.state
        return decision.num_replicas

    assert ramp(FIXED) == 3  # 780 + 31 s of the trend's 1.7 tok/s/s passes 800
    assert ramp(dataclasses.replace(FIXED, scale_in_trend_time_s=None)) == 2


def test_holds_while_a_replica_has_not_reported_or_starts():
    covered = [replica(100.0)] * 3
    assert slo_decision(signals(covered + [None], now=600.0), FIXED, settled(covered)).num_replicas == 4
    assert slo_decision(signals(covered, target=4, now=600.0), FIXED, settled(covered)).num_replicas == 4


def test_an_idle_deployment_goes_to_zero_only_when_min_replicas_allows():
    idle = [replica(0.0, running=0.0)]
    assert slo_decision(signals(idle, ongoing=0.0, low=0), FIXED, dict(WATCHED)).num_replicas == 0
    assert slo_decision(signals(idle, ongoing=0.0, low=1), FIXED, dict(WATCHED)).num_replicas == 1
    # Anything ongoing keeps the replica.
    assert slo_decision(signals(idle, ongoing=1.0, low=0), FIXED, dict(WATCHED)).num_replicas == 1
    # In the replicas' first window the count only goes up.
    assert slo_decision(signals(idle, ongoing=0.0, low=0), FIXED, {}).num_replicas == 1


def test_in_the_replicas_first_window_a_rate_over_a_second_neither_scales_out_nor_seeds_the_forecast():
    # A deployment's first report: its rates over the one second since the replica started, at 1.5x one
    # replica's capacity.
    opening = [replica(1.5 * CAPACITY)]
    first = slo_decision(signals(opening, now=1.0), FIXED, {})
    assert first.num_replicas == 1 and "first window" in first.reason
    assert set(first.state) == {"reported_since"}  # the forecaster starts from nothing it saw then
    state = first.state
    for t in range(2, 11):  # the next seconds' reports, the rate settling at half a replica's capacity
        state = slo_decision(signals([replica(0.5 * CAPACITY)], now=float(t)), FIXED, state).state
    after = slo_decision(signals([replica(0.5 * CAPACITY)], now=11.0), FIXED, state)
    assert after.num_replicas == 1 and after.state["demand"]["level"] == 0.5 * CAPACITY
    # Ongoing requests past the fallback's target, or a queue the replica cannot drain, still scale out at once.
    assert slo_decision(signals(opening, now=1.0, ongoing=100.0), FIXED, {}).num_replicas == 4
    queued = [replica(1.5 * CAPACITY, waiting=40.0, kv=0.95)]
    assert slo_decision(signals(queued, now=1.0), FIXED, {}).num_replicas >= 2
    # After a start from zero, the first window again.
    zero = slo_decision(signals([], now=500.0, ongoing=3.0), FIXED, after.state)
    assert "reported_since" not in zero.state
    # The first replica from zero has no earlier replicas' averages to wait out: a queue it cannot drain scales out
    # at once (after a scale-out from one or more, the safety net waits a look-back window: below).
    waking = slo_decision(signals([], now=500.0, ongoing=40.0, target=1), FIXED, zero.state)
    woke = slo_decision(signals(queued, now=515.0), FIXED, waking.state)
    assert "arrived_at" not in woke.state and woke.num_replicas >= 2 and "overloaded" in woke.reason


def test_before_any_capacity_is_reported_serves_rule_on_ongoing_requests_only_upward():
    silent = [ReplicaSignals(kv_usage=0.2, num_waiting=0, num_running=4)] * 2
    assert slo_decision(signals(silent, ongoing=100.0), FIXED, {}).num_replicas == 4
    assert slo_decision(signals(silent, ongoing=1.0), FIXED, {}).num_replicas == 2


def test_the_start_up_it_measures_replaces_the_configured_one_in_its_lead_time():
    config = SLOConfig(startup_s=15.0)
    state = slo_decision(signals([replica(100.0)] * 2, target=3, now=100.0), config, {}).state
    state = slo_decision(signals([replica(100.0)] * 3, now=140.0), config, state).state
    assert state["startup_s"] == 40.0
    assert lead_time_s(signals([replica(100.0)]), state["startup_s"]) == 10.0 + 40.0 + 5.0 + 1.0


def test_before_it_has_seen_its_plans_come_true_the_headroom_is_the_poisson_spread_over_a_lead_time():
    few, many = prior_headroom(0.5, 30.0, 0.95), prior_headroom(20.0, 30.0, 0.95)
    assert 0 < many < few <= 0.5
    assert prior_headroom(2.0, 30.0, 0.99) > prior_headroom(2.0, 30.0, 0.9)


def test_the_surprise_is_how_far_the_load_outgrew_the_plans_one_lead_time_later_at_the_percentile():
    state: dict = {}
    lead = 30.0
    steady = [observed_surprise(state, i * SAMPLE_S, 100.0, 100.0, lead, 0.95) for i in range(60)]
    assert steady[MIN_SAMPLES] is None and steady[-1] == 0.0  # no surprise: nothing held
    bursty: dict = {}
    for i in range(240):  # one 30 s burst of three times the load every 4 minutes, unforeseen each time
        load = 300.0 if (i * SAMPLE_S) % 240 < 30 else 100.0
        surprise = observed_surprise(bursty, i * SAMPLE_S, 100.0, load, lead, 0.95)
    assert surprise == pytest.approx(200.0)  # the burst's height: the bursts are more than 5% of the time
    # Planning for the burst's level already, only what the history's peak is above it is held.
    assert observed_surprise(bursty, 239 * SAMPLE_S + 1.0, 250.0, 300.0, lead, 0.95) == pytest.approx(50.0)
    assert observed_surprise(bursty, 239 * SAMPLE_S + 2.0, 300.0, 300.0, lead, 0.95) == 0.0
    assert len(bursty["plans"]) <= 1200.0 / SAMPLE_S + 1
    # Short bursts, 4% of the time but a sixth of the requests: held, at the percentile of requests, not of time.
    rare: dict = {}
    for i in range(240):
        load = 500.0 if (i * SAMPLE_S) % 250 < 10 else 100.0
        surprise = observed_surprise(rare, i * SAMPLE_S, 100.0, load, lead, 0.95)
    assert surprise == pytest.approx(400.0)


def test_between_bursts_it_holds_capacity_for_the_next_one_and_within_a_burst_no_more_than_the_burst_needs():
    config = SLOConfig()  # the observed surprise, not a stated headroom

    def watched(burst_load: float) -> dict:
        state: dict = {}
        for t in range(0, 1200, 5):  # 30 s bursts every 4 minutes over 400 tok/s, on 8 replicas
            load = burst_load if t % 240 < 30 else 400.0
            state = slo_decision(signals([replica(load / 8)] * 8, now=float(t), high=12), config, state).state
        return state

    bursty, steady = watched(2000.0), watched(400.0)
    quiet = [replica(400.0 / 8)] * 8
    held = slo_decision(signals(quiet, now=1200.0, high=12), config, bursty).num_replicas
    assert held > slo_decision(signals(quiet, now=1200.0, high=12), config, steady).num_replicas + 1
    # ... at the burst's height, though the smoothed load it watches reached about half of it within a lead time.
    assert held >= math.ceil(2000.0 / CAPACITY)
    burst = slo_decision(signals([replica(2000.0 / 8)] * 8, now=1200.0, high=12), config, bursty)
    assert burst.num_replicas <= math.ceil(2000.0 / CAPACITY) + 1  # not a burst's height again on top


def test_serve_adapter_reads_capacity_from_aggregated_metrics_and_keeps_its_state_under_its_key():
    policy = SLOPolicy(headroom=0.2)
    metrics = {"kv_usage": {"a": 0.3, "b": 0.3}, "num_waiting": {"a": 0.0, "b": 0.0},
               "num_running": {"a": 8.0, "b": 8.0}, "capacity_tokens_per_s": {"a": CAPACITY, "b": CAPACITY},
               "capacity_alone_tokens_per_s": {"a": ALONE, "b": ALONE},
               "demand_tokens_per_s": {"a": 900.0, "b": 900.0}, "arrivals_per_s": {"a": 2.0, "b": 2.0}}
    ctx = SimpleNamespace(deployment_name="EngineReplica", aggregated_metrics=metrics, running_replicas=["a", "b"],
                          current_num_replicas=2, target_num_replicas=2, capacity_adjusted_min_replicas=1,
                          capacity_adjusted_max_replicas=8, total_num_requests=16.0,
                          policy_state={STATE_KEY: dict(WATCHED)},
                          current_time=100.0, config=SimpleNamespace(upscale_delay_s=10.0, look_back_period_s=10.0,
                                                                     metrics_interval_s=1.0))
    replicas, state = policy(ctx)
    assert replicas == 5  # 1800 / (500 * 0.8) = 4.5
    assert set(state) == {STATE_KEY} and state[STATE_KEY]["demand"]["level"] == 1800.0


def test_settings_validate_and_become_serves_policy():
    with pytest.raises(ValueError):
        SLOConfig(percentile=1.0)
    with pytest.raises(ValueError):
        SLOConfig(headroom=1.5)
    with pytest.raises(ValidationError, match="min_replicas 0"):
        AutoscalingArgs(enabled=True, policy="queue_kv", min_replicas=0)
    args = AutoscalingArgs(enabled=True, policy="slo", min_replicas=0, downscale_to_zero_delay_s=60,
                           slo={"ttft_s": 1.5})
    config = engine_autoscaling_config(args, num_engine_replicas=1)
    assert config["policy"]["policy_function"] == "autoscaling.slo_policy:SLOPolicy"
    assert config["policy"]["policy_kwargs"]["ttft_s"] == 1.5
    assert config["min_replicas"] == 0 and config["initial_replicas"] == 1
    assert config["downscale_to_zero_delay_s"] == 60


PROFILE = ReplicaProfile.load(DEFAULT_PROFILE)
SERVE = ServeAutoscalingConfig(min_replicas=1, max_replicas=6, upscale_delay_s=5.0, downscale_delay_s=30.0,
                               look_back_period_s=5.0, metrics_interval_s=1.0)


def test_in_the_simulator_it_follows_a_step_up_and_down_and_holds_the_slo():
    shape = ShapedWorkload("steps", duration_s=600.0, seed=7)
    sizes = [(r.prompt_tokens, r.output_tokens) for r in shape.requests()[:512]]
    alone = CapacityModel(PROFILE, SLO()).capacity(RequestSizes(
        np.array([p for p, _ in sizes], dtype=float), np.zeros(len(sizes)),
        np.array([o for _, o in sizes], dtype=float))).alone_requests_per_s
    steps = dataclasses.replace(shape, rate=1.5 * alone)  # its levels then need one replica to several
    result = simulate(steps.requests(), PROFILE, SLOSimPolicy(), ClusterConfig(serve=SERVE, startup_s=10.0))
    alive = [p.running + p.starting + p.draining for p in result.timeline]
    assert min(alive) == 1 and max(alive) > 2
    good = [r for r in result.requests if r.finish_s is not None and r.first_token_s - r.spec.arrival_s <= 2.0]
    assert len(good) / len(result.requests) > 0.9
    assert all(r.finish_s is not None for r in result.requests)


def test_in_the_simulator_from_zero_replicas_the_first_request_waits_for_the_first_replica_and_none_is_lost():
    serve = dataclasses.replace(SERVE, min_replicas=0, downscale_to_zero_delay_s=5.0)
    alone = RequestSpec(0.0, 200, 40)
    quiet_then_burst = [alone] + [RequestSpec(200.0 + 0.5 * i, 200, 40) for i in range(6)]
    cluster = ClusterConfig(serve=serve, initial_replicas=0, startup_s=12.0)
    result = simulate(quiet_then_burst, PROFILE, SLOSimPolicy(), cluster)
    assert all(r.finish_s is not None for r in result.requests), [r.failed for r in result.requests]
    # The same requests on a replica that is always there: each one's own latency.
    warm = simulate(quiet_then_burst, PROFILE, SLOSimPolicy(),
                    dataclasses.replace(cluster, serve=dataclasses.replace(serve, min_replicas=1), initial_replicas=1))
    for i in (0, 1):  # from zero at the start, and again after it went idle
        waited = result.requests[i].finish_s - result.requests[i].spec.arrival_s
        own_s = warm.requests[i].finish_s - warm.requests[i].spec.arrival_s
        assert cluster.startup_s < waited <= cluster.startup_s + own_s + 2 * cluster.control_interval_s
    alive = [(p.t, p.running + p.starting) for p in result.timeline]
    assert any(n == 0 for t, n in alive if 20.0 < t < 200.0), "idle, it went back to zero replicas"
