"""bench-autoscale states how much work each workload offers, in replicas' worth: a flat load leaves no policy
anything to scale."""
from __future__ import annotations

import pytest

from autoscaling.step_model import DEFAULT_PROFILE, ReplicaProfile
from autoscaling.workload import RequestSpec, saturation_rate
from benchmarks.bench_autoscale import Case, offered_load


def test_the_offered_load_is_the_windows_work_in_replicas_worth_whole_and_per_window():
    model = ReplicaProfile.load(DEFAULT_PROFILE).step_model
    one = RequestSpec(0.0, 256, 64)
    per_request_s = 1.0 / saturation_rate(model, [one])
    rate = 2.0 / per_request_s  # two replicas' worth
    # 0-60 s at that rate, then 60-120 s at half of it; before the window and after it, requests that do not count
    arrivals = [-5.0 + i / rate for i in range(int(5 * rate))] + [i / rate for i in range(int(60 * rate))] + \
        [60.0 + 2 * i / rate for i in range(int(30 * rate))] + [125.0]
    case = Case("two levels", [RequestSpec(t, 256, 64) for t in arrivals], 0.0, 120.0)
    load = offered_load(case, model, bin_s=30.0)
    assert load["mean"] == pytest.approx(1.5, rel=0.03)
    assert load["max"] == pytest.approx(2.0, rel=0.03) and load["min"] == pytest.approx(1.0, rel=0.03)
