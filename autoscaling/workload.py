"""The requests a simulation replays: synthetic (an arrival process and length distributions) or a Mooncake trace.

Lengths and arrival times come from the load generator's own helpers (loadtests/), so a simulated workload and a
real benchmark run of the same settings see the same requests.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

import numpy as np

from autoscaling.step_model import StepTimeModel
from loadtests.arrivals import arrival_offsets
from loadtests.datasets import TraceConfig, load_trace, sample_lengths, scaled_input_length, trace_window


@dataclass(frozen=True)
class RequestSpec:
    """One simulated request: when it arrives and how many tokens it has and wants."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_ids: tuple[int, ...] = ()  # one id per `tokens_per_prefix_id` prompt tokens; equal ids, equal tokens
    tokens_per_prefix_id: int = 0
    max_tokens: int | None = None  # what the client asked for, if it said (None: no cap below the engine's)


@dataclass(frozen=True)
class SyntheticWorkload:
    """Random lengths (normal, as `loadtests.datasets.sample_lengths`) and arrivals (`loadtests.arrivals`).

    rate None sends every request at once, like `make bench-engine`."""

    num_requests: int
    rate: float | None = None
    arrival: Literal["constant", "poisson", "gamma"] = "poisson"
    burstiness: float = 1.0
    input_mean: int = 256
    input_std: float = 0.0
    output_mean: int = 128
    output_std: float = 0.0
    seed: int = 0

    def requests(self) -> list[RequestSpec]:
        rng = np.random.default_rng(self.seed)
        inputs = sample_lengths(rng, self.input_mean, self.input_std, self.num_requests)
        outputs = sample_lengths(rng, self.output_mean, self.output_std, self.num_requests)
        arrivals = ([0.0] * self.num_requests if self.rate is None else
                    arrival_offsets(self.num_requests, self.rate, self.arrival, self.burstiness, self.seed))
        return [RequestSpec(t, i, o) for t, i, o in zip(arrivals, inputs, outputs)]


@dataclass(frozen=True)
class TraceWorkload:
    """A Mooncake trace scaled to a small model: `block_size` tokens per hash id (512 in the trace) and arrival
    gaps times `time_scale`; `max_output_tokens` caps each request's output."""

    path: str
    block_size: int = 8
    time_scale: float = 1.0
    start_ms: float | None = None
    end_ms: float | None = None
    max_requests: int | None = None
    max_output_tokens: int | None = None

    def requests(self) -> list[RequestSpec]:
        cfg = TraceConfig(block_size=self.block_size, time_scale=self.time_scale, start_ms=self.start_ms,
                          end_ms=self.end_ms, max_requests=self.max_requests,
                          max_output_tokens=self.max_output_tokens)
        rows = trace_window(load_trace(Path(self.path).expanduser()), cfg)
        if not rows:
            raise ValueError(f"the window of {self.path} holds no requests")
        t0 = rows[0].timestamp_ms
        specs = []
        for row in rows:
            out = row.output_length if cfg.max_output_tokens is None else min(row.output_length,
                                                                                cfg.max_output_tokens)
            specs.append(RequestSpec((row.timestamp_ms - t0) / 1000.0 * self.time_scale,
                                     scaled_input_length(row, self.block_size, cfg.trace_block_size), max(1, out),
                                     row.hash_ids, self.block_size))
        return specs


@dataclass(frozen=True)
class ShapedWorkload:
    """Poisson arrivals whose rate follows a shape over `duration_s`, in multiples of `rate`; lognormal lengths.

    steps: six levels held for a sixth of the run each, drawn from [0.3, 2] by the seed; bursts: 0.6 with bursts
    of 2.5 lasting 30 to 90 s, about one every 3 minutes; daily: one day folded into the run, from 0.2 at night
    to 1.8 at noon, with slow noise. The seed draws the shape's details as well as the requests, so workloads of
    one shape and different seeds are different workloads.
    """

    shape: Literal["steps", "bursts", "daily"]
    duration_s: float = 1200.0
    rate: float = 1.5
    input_mean: int = 240
    input_cv: float = 1.0
    output_mean: int = 150
    output_cv: float = 1.0
    max_input: int = 1500
    max_output: int = 900
    seed: int = 0

    def rate_at(self, t: float) -> float:
        s = self._shape
        if self.shape == "steps":
            return self.rate * float(s["levels"][min(5, int(6 * t / self.duration_s))])
        if self.shape == "bursts":
            inside = any(b <= t < b + n for b, n in zip(s["starts"], s["lengths"]))
            return self.rate * (2.5 if inside else 0.6)
        day = 1.0 - 0.8 * np.cos(2 * np.pi * t / self.duration_s)
        noise = 0.1 * sum(np.sin(2 * np.pi * (k + 3) * t / self.duration_s + p) for k, p in enumerate(s["phases"]))
        return self.rate * float(max(0.1, day + noise))

    def requests(self) -> list[RequestSpec]:
        rng = np.random.default_rng(self.seed)
        peak = max(self.rate_at(t) for t in np.arange(0, self.duration_s, 1.0))
        specs, t = [], 0.0
        while True:  # thinning: candidates at the peak rate, each kept with probability rate(t) / peak
            t += rng.exponential(1.0 / peak)
            if t >= self.duration_s:
                return specs
            if rng.random() * peak <= self.rate_at(t):
                specs.append(RequestSpec(t, _lognormal(rng, self.input_mean, self.input_cv, self.max_input),
                                         _lognormal(rng, self.output_mean, self.output_cv, self.max_output)))

    @cached_property
    def _shape(self) -> dict[str, np.ndarray]:
        """The shape's details, drawn once from the seed (apart from the requests' own draws)."""
        rng = np.random.default_rng(self.seed + 7919)
        if self.shape == "steps":
            return {"levels": rng.uniform(0.3, 2.0, size=6)}
        if self.shape == "bursts":
            starts = np.cumsum(rng.exponential(180.0, size=int(self.duration_s / 60) + 2))
            return {"starts": starts, "lengths": rng.uniform(30.0, 90.0, size=len(starts))}
        if self.shape == "daily":
            return {"phases": rng.uniform(0, 2 * np.pi, size=3)}
        raise ValueError(f"unknown workload shape {self.shape!r}: use steps, bursts or daily")


def _lognormal(rng: np.random.Generator, mean: float, cv: float, cap: int) -> int:
    sigma = np.sqrt(np.log(1 + cv * cv))
    return int(min(cap, max(1, round(rng.lognormal(np.log(mean) - sigma * sigma / 2, sigma)))))


# The shaped workloads' base rate, in replicas' worth of work at full use: their shapes then span one replica to
# several (bursts of 2.5x need about four at the SLO) whatever the replica profile's speed.
REPLICAS_OF_WORK = 1.5


def saturation_rate(model: StepTimeModel, requests: list[RequestSpec]) -> float:
    """Requests per second that keep one replica busy all the time: the step model's seconds of work per request
    (its prefill, and each output token's share of a decode step at its context), base left out."""
    work = 0.0
    for r in requests:
        prefill = model.seconds(r.prompt_tokens, 0, 0, r.prompt_tokens * r.prompt_tokens / 2e6) - model.base
        context = r.prompt_tokens + r.output_tokens / 2
        work += prefill + r.output_tokens * (model.seconds(0, 1, int(context), 0.0) - model.base)
    return len(requests) / work


def scaled_to(model: StepTimeModel, shape: ShapedWorkload) -> ShapedWorkload:
    """The shape with its base rate set to `REPLICAS_OF_WORK` replicas' worth of work on replicas of `model`; the
    work per request is read off the shape's own lengths, drawn with a seed of their own (no run's requests)."""
    sample = ShapedWorkload("steps", duration_s=4000.0, rate=1.0, input_mean=shape.input_mean, input_cv=shape.input_cv,
                            output_mean=shape.output_mean, output_cv=shape.output_cv, max_input=shape.max_input,
                            max_output=shape.max_output, seed=1).requests()
    return dataclasses.replace(shape, rate=REPLICAS_OF_WORK * saturation_rate(model, sample))
