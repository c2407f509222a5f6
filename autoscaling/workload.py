"""The requests a simulation replays: synthetic (an arrival process and length distributions) or a Mooncake trace.

Lengths and arrival times come from the load generator's own helpers (loadtests/), so a simulated workload and a
real benchmark run of the same settings see the same requests.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

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
