"""Which prompts a run sends: the dataset choice and its settings, turned into RequestSpecs."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from loadtests.datasets import (
    SharedPrefixConfig, SyntheticConfig, TraceConfig, load_trace, shared_prefix_specs, synthetic_specs, trace_specs,
    trace_window,
)
from loadtests.prompts import PromptBuilder
from loadtests.records import RequestSpec

Dataset = Literal["synthetic", "shared-prefix", "trace"]
WARMUP_INDEX_BASE = 10_000_000  # warm-up prompts never repeat profiling prompts (that would warm the prefix cache)
POOL_SIZE = 256  # prompts built for a duration-bounded run; the run cycles through them


@dataclass(frozen=True)
class InputConfig:
    dataset: Dataset = "synthetic"
    input_mean: int = 256
    input_std: float = 0.0
    output_mean: int = 128
    output_std: float = 0.0
    num_prefixes: int = 4
    prefix_len: int = 256
    suffix_len: int = 64
    trace_path: Path | None = None
    trace: TraceConfig = field(default_factory=TraceConfig)
    seed: int = 0


def build_specs(builder: PromptBuilder, cfg: InputConfig, num_requests: int | None) -> list[RequestSpec]:
    """The profiling requests: `num_requests` of them, or a pool to cycle when the run is bounded by time."""
    if cfg.dataset == "trace":
        if cfg.trace_path is None:
            raise ValueError("the trace dataset needs --trace FILE")
        rows = load_trace(cfg.trace_path)
        trace = cfg.trace
        if num_requests is not None:
            trace = replace(trace, max_requests=min(num_requests, len(trace_window(rows, trace))))
        return trace_specs(builder, rows, trace)
    n = num_requests if num_requests is not None else POOL_SIZE
    if cfg.dataset == "shared-prefix":
        return shared_prefix_specs(builder, SharedPrefixConfig(n, cfg.num_prefixes, cfg.prefix_len, cfg.suffix_len,
                                                               cfg.output_mean, cfg.output_std, cfg.seed))
    return synthetic_specs(builder, SyntheticConfig(n, cfg.input_mean, cfg.input_std, cfg.output_mean,
                                                    cfg.output_std, cfg.seed))


def build_warmup(builder: PromptBuilder, cfg: InputConfig, n: int) -> list[RequestSpec]:
    """Warm-up requests: synthetic prompts of the configured lengths, never the profiling prompts themselves."""
    if n <= 0:
        return []
    return synthetic_specs(builder, SyntheticConfig(n, cfg.input_mean, cfg.input_std, cfg.output_mean, cfg.output_std,
                                                    cfg.seed + 1), first_index=WARMUP_INDEX_BASE)


class PromptCycle:
    """Requests handed out in order and cycled, renumbered as they go (all Locust users of a process share one)."""

    def __init__(self, specs: list[RequestSpec], builder: PromptBuilder) -> None:
        if not specs:
            raise ValueError("no prompts to cycle through")
        self.specs = specs
        self.builder = builder
        self._counter = itertools.count()

    def next(self) -> RequestSpec:
        n = next(self._counter)
        return replace(self.specs[n % len(self.specs)], index=n, send_offset_s=None)
