"""Fit the SLO policy's forecaster (Holt's time constants) on synthetic workloads that `make bench-autoscale`
never evaluates on.

The training workloads are the benchmark's shapes (steps, bursts, daily), at the benchmark's rate for the profile,
drawn with their own seeds (`TRAINING_SEEDS`; the benchmark uses seed 0 and the Mooncake trace). For each, the token
demand the policy sees is rebuilt from the requests: tokens arriving over the replicas' 10 s window, averaged again
over Serve's 10 s look-back, sampled every 0.5 s. Every (level, trend) pair of the grid forecasts that series one
lead time ahead (`lead_s`, the policy's default: 15 s start-up, 10 s upscale delay, half the look-back, the push
interval); the pair with the least mean squared relative error, summed over the workloads, wins. The level's
error is flat from 5 to 45 s; SLOConfig keeps 45 s, the smoothest within that, for what the policy costs on these
seeds (its comment).

    python -m benchmarks.fit_forecast --out results/fit_forecast.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
from pathlib import Path

import numpy as np

from autoscaling.demand import DEMAND_WINDOW_S
from autoscaling.forecast import Holt
from autoscaling.step_model import DEFAULT_PROFILE, ReplicaProfile
from autoscaling.workload import ShapedWorkload, scaled_to

log = logging.getLogger("fit_forecast")

TRAINING_SEEDS = (100, 101, 102, 103)
SHAPES = ("steps", "bursts", "daily")
LEVEL_TIMES_S = (5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 90.0)
TREND_TIMES_S = (15.0, 30.0, 60.0, 120.0, 240.0, None)  # None: no trend
SAMPLE_S = 0.5
LOOK_BACK_S = 10.0


def observed_demand(workload: ShapedWorkload) -> tuple[np.ndarray, np.ndarray]:
    """(times, tokens/s) as the policy reads it: a window on the replicas, then Serve's look-back average."""
    requests = workload.requests()
    arrivals = np.array([r.arrival_s for r in requests])
    tokens = np.array([r.prompt_tokens + r.output_tokens for r in requests], dtype=float)
    times = np.arange(0.0, workload.duration_s, SAMPLE_S)
    cumulative = np.concatenate([[0.0], np.cumsum(tokens)])
    windowed = (cumulative[np.searchsorted(arrivals, times, side="right")]
                - cumulative[np.searchsorted(arrivals, times - DEMAND_WINDOW_S, side="right")]) / DEMAND_WINDOW_S
    per_look_back = int(LOOK_BACK_S / SAMPLE_S)
    smoothed = np.convolve(windowed, np.ones(per_look_back) / per_look_back)[: len(windowed)]
    return times, smoothed


def forecast_error(times: np.ndarray, demand: np.ndarray, holt: Holt, lead_s: float) -> float:
    """Mean squared error of the forecast one lead time ahead, relative to the series' mean."""
    ahead = int(round(lead_s / SAMPLE_S))
    state = None
    predicted = np.empty(len(times))
    for i, (t, value) in enumerate(zip(times, demand)):
        state = holt.update(state, float(value), float(t))
        predicted[i] = holt.forecast(state, lead_s)
    errors = (predicted[:-ahead] - demand[ahead:]) / max(float(np.mean(demand)), 1e-9)
    return float(np.mean(errors[int(60 / SAMPLE_S):] ** 2))  # after the first minute's warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lead-s", type=float, default=15.0 + 10.0 + LOOK_BACK_S / 2 + 1.0)
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE), help="the replicas the workloads are sized for")
    parser.add_argument("--out", default="results/fit_forecast.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = ReplicaProfile.load(args.profile).step_model
    series = [observed_demand(scaled_to(model, ShapedWorkload(shape, seed=seed)))
              for shape in SHAPES for seed in TRAINING_SEEDS]
    grid = []
    for level_s, trend_s in itertools.product(LEVEL_TIMES_S, TREND_TIMES_S):
        holt = Holt(level_s, trend_s)
        error = sum(forecast_error(t, d, holt, args.lead_s) for t, d in series) / len(series)
        grid.append({"level_time_s": level_s, "trend_time_s": trend_s, "mean_squared_relative_error": error})
        log.info("level %5.0fs trend %6s: %.4f", level_s, "off" if trend_s is None else f"{trend_s:.0f}s", error)
    best = min(grid, key=lambda row: row["mean_squared_relative_error"])
    print(f"best: level_time_s={best['level_time_s']:g}, trend_time_s={best['trend_time_s']} "
          f"(mean squared relative error {best['mean_squared_relative_error']:.4f} at {args.lead_s:g} s ahead)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"lead_s": args.lead_s, "shapes": SHAPES, "seeds": TRAINING_SEEDS, "best": best,
                               "grid": grid}, indent=2) + "\n")


if __name__ == "__main__":
    main()
