"""What a replica reports to the SLO policy: its capacity at the SLO (from the profile and its own steps) and the
load it is offered; and the forecaster the policy runs on that load."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autoscaling.capacity import PRIOR_S, SLO, CapacityModel, RequestSizes, StepStats, StepWindow
from autoscaling.demand import DemandMeter
from autoscaling.forecast import Holt
from autoscaling.serve_rules import ServeAutoscalingConfig
from autoscaling.simulator import ClusterConfig, OngoingRequestsPolicy, simulate
from autoscaling.step_model import DEFAULT_PROFILE, ReplicaProfile
from autoscaling.workload import RequestSpec, ShapedWorkload

PROFILE = ReplicaProfile.load(DEFAULT_PROFILE)
MODEL = CapacityModel(PROFILE, SLO())


def sizes_of(requests: list[RequestSpec]) -> RequestSizes:
    return RequestSizes(np.array([r.prompt_tokens for r in requests], dtype=float), np.zeros(len(requests)),
                        np.array([r.output_tokens for r in requests], dtype=float))


def mix(seed: int = 1, n: int = 512, **lengths) -> list[RequestSpec]:
    """Request sizes drawn as the synthetic workloads draw them (their arrival times are not used)."""
    return ShapedWorkload("steps", duration_s=4 * n, rate=1.0, seed=seed, **lengths).requests()[:n]


def steps_like_the_profile(slowdown: float, start: float = 0.0, count: int = 200) -> list[StepStats]:
    """Steps of a decode batch, each `slowdown` times as long as the profile predicts."""
    predicted = PROFILE.step_model.seconds(0, 16, 16 * 400, 0.0)
    return [StepStats(start + i * predicted * slowdown, predicted * slowdown, 0, 16, 16 * 400, 0.0)
            for i in range(count)]


def test_before_any_request_a_replica_reports_the_profiles_capacity():
    assert MODEL.capacity(None) == MODEL.capacity(MODEL.prior)
    assert MODEL.capacity(None).tokens_per_s > 0


def test_a_replica_whose_steps_run_twice_as_long_as_the_profile_says_reports_about_half_the_capacity():
    window = StepWindow(MODEL)
    steps = steps_like_the_profile(2.0)
    for step in steps:
        window.add(step)
    correction = window.correction(now=10.0)
    predicted = sum(s.duration_s for s in steps) / 2
    # The profile's own prediction is a prior worth PRIOR_S seconds of steps that ran as predicted.
    assert correction == pytest.approx((2 * predicted + PRIOR_S) / (predicted + PRIOR_S))
    assert 1.3 < correction < 2.0
    sizes = sizes_of(mix())
    slow, normal = MODEL.capacity(sizes, correction), MODEL.capacity(sizes)
    assert slow.tokens_per_s <= 1.01 * normal.tokens_per_s / correction  # each step's time over the correction
    # Steps older than the window no longer count.
    assert window.correction(now=1000.0) == 1.0


def test_a_snapshot_of_the_step_ring_is_added_once():
    window = StepWindow(MODEL)
    ring = steps_like_the_profile(2.0, count=50)
    window.add_new(ring)
    first = window.correction(now=5.0)
    window.add_new(ring + steps_like_the_profile(2.0, start=ring[-1].time + 0.1, count=5))
    assert window.correction(now=5.0) > first  # only the five new steps were added
    assert len(window._steps) == 55


def test_requests_that_miss_the_ttft_objective_on_any_number_of_replicas_do_not_drive_the_capacity_to_zero():
    """More of them than the SLO's 5% would leave no rate that holds it, and so no replica count: they are left
    out of the share that must meet it (their prefills still cost the others their time)."""
    requests = mix()
    hopeless = [dataclasses.replace(r, prompt_tokens=8000) for r in requests[:40]]  # seconds of prefill each
    with_them = MODEL.capacity(sizes_of(requests[40:] + hopeless))
    without = MODEL.capacity(sizes_of(requests[40:]))
    assert with_them.feasible_share < 0.93
    assert 0 < with_them.requests_per_s < without.requests_per_s


def test_a_replica_sustains_more_beside_others_than_alone_and_a_tighter_slo_lowers_both():
    """Beside others a replica's prompts collide less (the router spreads them); where the SLO, not the bound of
    max_num_seqs running at once, limits the rate, it sustains more there than alone."""
    sizes = sizes_of(mix())
    capacity = MODEL.capacity(sizes)
    assert capacity.requests_per_s >= capacity.alone_requests_per_s
    tight = CapacityModel(PROFILE, SLO(ttft_s=1.0, itl_s=0.1, percentile=0.99)).capacity(sizes)
    assert tight.requests_per_s > tight.alone_requests_per_s
    assert tight.requests_per_s < capacity.requests_per_s
    assert tight.alone_requests_per_s < capacity.alone_requests_per_s


@pytest.mark.parametrize("budget", ["profile", "whole"])
@pytest.mark.parametrize("replicas", [1, 4])
@pytest.mark.parametrize("lengths", [dict(input_mean=240, input_cv=1.0, output_mean=150, output_cv=1.0),
                                     dict(input_mean=300, input_cv=0.5, output_mean=100, output_cv=0.4)])
def test_the_rate_a_replica_sustains_at_the_slo_is_what_a_simulated_replica_sustains(lengths, replicas, budget):
    """Below the predicted rate the simulated replicas hold the SLO for 95% of the requests that can meet it at
    all; a little above it, they do not (the engine's scheduler and step model, Poisson arrivals, power-of-two
    routing between replicas). One replica alone is held to its lone rate, four to four times the pooled one.
    With the profile's step budget beside decodes (prompts queue for what the decodes leave of it), and with a
    step taking the whole budget whatever runs."""
    profile = PROFILE if budget == "profile" else dataclasses.replace(
        PROFILE, engine=dataclasses.replace(PROFILE.engine, max_tokens_with_decodes=None))
    requests = mix(seed=3, n=1500, **lengths)
    capacity = CapacityModel(profile, SLO()).capacity(sizes_of(requests[:512]))
    predicted = capacity.alone_requests_per_s if replicas == 1 else replicas * capacity.requests_per_s
    model = profile.step_model

    def missed(rate: float) -> float:
        arrivals = np.cumsum(np.random.default_rng(9).exponential(1 / rate, len(requests)))
        replay = [dataclasses.replace(r, arrival_s=float(t)) for r, t in zip(requests, arrivals)]
        result = simulate(replay, profile, OngoingRequestsPolicy(),
                          ClusterConfig(serve=ServeAutoscalingConfig(replicas, replicas), initial_replicas=replicas))
        feasible = [r for r in result.requests if model.seconds(r.spec.prompt_tokens, 0, 0, r.spec.prompt_tokens ** 2
                                                                / 2e6) + 2 * model.base <= 2.0]
        return float(np.mean([r.first_token_s - r.spec.arrival_s > 2.0 or (
            r.output_done > 1 and (r.last_token_s - r.first_token_s) / (r.output_done - 1) > 0.2)
            for r in feasible]))

    assert missed(0.85 * predicted) <= 0.05
    assert missed(1.2 * predicted) > 0.05


def test_offered_load_counts_the_window_s_arrivals_with_the_outputs_and_cache_hits_of_recent_requests():
    meter = DemandMeter(MODEL.prior)
    for t in range(10):
        meter.arrived(float(t), prompt_tokens=200, max_tokens=1000)
    before = meter.demand(10.0)
    assert before.arrivals_per_s == pytest.approx(1.0)
    expected_output = float(np.mean(MODEL.prior.output))
    assert before.tokens_per_s == pytest.approx(200 + expected_output)
    for _ in range(10):
        meter.finished(prompt_tokens=200, cached_tokens=100, output_tokens=50)
    after = meter.demand(10.0)
    assert after.tokens_per_s == pytest.approx(100 + 50)  # half of each prompt cached, 50 tokens out
    meter.arrived(10.5, prompt_tokens=200, max_tokens=10)  # asks for fewer than requests usually get
    assert meter.demand(10.5).tokens_per_s == pytest.approx((9 * 150 + 100 + 10) / 10)  # the one at 0 left
    assert meter.demand(30.0).tokens_per_s == 0.0  # nothing arrived in the last window


def test_holt_follows_a_ramp_and_without_a_trend_follows_the_level():
    holt, flat = Holt(level_time_s=10.0, trend_time_s=30.0), Holt(level_time_s=10.0, trend_time_s=None)
    state = flat_state = None
    for second in range(300):
        value = 100.0 + 2.0 * second
        state = holt.update(state, value, float(second))
        flat_state = flat.update(flat_state, value, float(second))
    assert state.trend == pytest.approx(2.0, rel=0.05)
    assert holt.forecast(state, 30.0) == pytest.approx(100 + 2 * 329, rel=0.02)
    assert flat_state.trend == 0.0 and flat.forecast(flat_state, 30.0) < 100 + 2 * 299
    falling = holt.update(state, 0.0, 400.0)
    assert holt.forecast(falling, 1000.0) >= 0.0  # a forecast of load is never negative
    with pytest.raises(ValueError):
        Holt(level_time_s=0.0, trend_time_s=None)
