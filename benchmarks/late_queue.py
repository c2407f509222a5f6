"""An overloaded replica's queue in arrival order against one ordered for a TTFT objective (engine.ttft_objective_s).

One simulated replica of the recorded profile (autoscaling/replica.py, the engine's scheduler restated), no
autoscaling, offered 400 requests (240-token prompts, 150-token outputs on average) at 1.2, 2 and 3 times the rate
it sustains (autoscaling.workload.saturation_rate). Printed per load: the share of requests whose first token came
within the TTFT objective (their inter-token latency not judged), with the queue in arrival order, with a request
going behind those on time once it has waited half the objective (the engine's rule, engine.scheduler.LATE_SHARE),
and once it has waited the whole objective (the simulator run with twice the objective: its line falls at the
objective itself). Writes JSON.

    python -m benchmarks.late_queue    # 2 s objective; a few seconds
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from autoscaling.replica import LATE_SHARE
from autoscaling.report import SLO, summarize
from autoscaling.serve_rules import ServeAutoscalingConfig
from autoscaling.simulator import ClusterConfig, OngoingRequestsPolicy, simulate
from autoscaling.step_model import DEFAULT_PROFILE, ReplicaProfile
from autoscaling.workload import RequestSpec, SyntheticWorkload, saturation_rate

LOADS = (1.2, 2.0, 3.0)


def requests_at(rate: float, seed: int) -> list[RequestSpec]:
    return SyntheticWorkload(400, rate=rate, input_mean=240, input_std=60, output_mean=150, output_std=40,
                             seed=seed).requests()


def attainment(requests: list[RequestSpec], profile: ReplicaProfile, slo: SLO, objective_s: float | None) -> float:
    one = ServeAutoscalingConfig(min_replicas=1, max_replicas=1)
    cluster = ClusterConfig(serve=one, initial_replicas=1, ttft_objective_s=objective_s)
    result = simulate(requests, profile, OngoingRequestsPolicy(float("inf")), cluster)
    return summarize(result, slo, 0.0, requests[-1].arrival_s + 1).attainment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE))
    parser.add_argument("--ttft-s", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--out", default="results/late_queue.json")
    args = parser.parse_args()
    profile = ReplicaProfile.load(args.profile)
    slo = SLO(ttft_s=args.ttft_s, itl_s=1e9, percentile=0.95)
    capacity = saturation_rate(profile.step_model, requests_at(1.0, args.seed))
    orders = {"arrival order": None, f"late at {LATE_SHARE:g} of the objective": args.ttft_s,
              "late at the whole objective": args.ttft_s / LATE_SHARE}
    rows = []
    print(f"one replica, {capacity:.2f} requests/s sustained; share of requests with TTFT <= {args.ttft_s:g} s")
    for load in LOADS:
        requests = requests_at(load * capacity, args.seed)
        row = {"load": load, **{name: attainment(requests, profile, slo, o) for name, o in orders.items()}}
        rows.append(row)
        print(f"  {load:g}x: " + ", ".join(f"{name} {row[name]:.1%}" for name in orders))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"ttft_s": args.ttft_s, "capacity_requests_per_s": capacity,
                                          "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
