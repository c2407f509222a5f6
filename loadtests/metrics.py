"""Per-request metrics and run statistics, with AIPerf's definitions and tags.

- time_to_first_token: first chunk with content − request start.
- time_to_second_token: second content chunk − first content chunk.
- request_latency: last content chunk − request start (the whole response when not streamed).
- inter_token_latency: (request_latency − time_to_first_token) / (output tokens − 1); needs ≥ 2 tokens.
- inter_chunk_latency: every gap between consecutive content chunks.
- output_token_throughput_per_user: 1 / inter_token_latency.
- Output tokens come from the server's usage when it reports them, else from re-tokenizing the output text.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from loadtests.records import RequestRecord

NS_PER_MS = 1e6
PERCENTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99)
STAT_KEYS = ("avg", "min", "max", "sum", *(f"p{p}" for p in PERCENTILES), "std")

# tag: (header, unit, larger is better)
METRIC_INFO: dict[str, tuple[str, str, bool]] = {
    "time_to_first_token": ("Time to First Token", "ms", False),
    "time_to_second_token": ("Time to Second Token", "ms", False),
    "request_latency": ("Request Latency", "ms", False),
    "inter_token_latency": ("Inter Token Latency", "ms", False),
    "inter_chunk_latency": ("Inter Chunk Latency", "ms", False),
    "output_token_throughput_per_user": ("Output Token Throughput Per User", "tokens/sec/user", True),
    "output_sequence_length": ("Output Sequence Length", "tokens", False),
    "input_sequence_length": ("Input Sequence Length", "tokens", False),
    "usage_prompt_tokens": ("Usage Prompt Tokens", "tokens", False),
    "usage_completion_tokens": ("Usage Completion Tokens", "tokens", False),
    "usage_prompt_cache_read_tokens": ("Usage Prompt Cache Read Tokens", "tokens", True),
    "request_throughput": ("Request Throughput", "requests/sec", True),
    "output_token_throughput": ("Output Token Throughput", "tokens/sec", True),
    "total_token_throughput": ("Total Token Throughput", "tokens/sec", True),
    "goodput": ("Goodput", "requests/sec", True),
    "good_request_count": ("Good Request Count", "requests", True),
    "good_request_fraction": ("Good Request Fraction", "ratio", True),
    "request_count": ("Request Count", "requests", True),
    "error_request_count": ("Error Request Count", "requests", False),
    "cancelled_request_count": ("Cancelled Request Count", "requests", False),
    "total_isl": ("Total Input Sequence Length", "tokens", True),
    "total_osl": ("Total Output Sequence Length", "tokens", True),
    "total_usage_prompt_cache_read_tokens": ("Total Usage Prompt Cache Read Tokens", "tokens", True),
    "overall_usage_prompt_cache_read_pct": ("Overall Usage Prompt Cache Read %", "%", True),
    "benchmark_duration": ("Benchmark Duration", "sec", False),
    "min_request_timestamp": ("Minimum Request Timestamp", "ns", False),
    "max_response_timestamp": ("Maximum Response Timestamp", "ns", False),
}


@dataclass(frozen=True)
class RecordMetrics:
    """One successful request's metrics (ms and tokens); None where the response did not allow one."""

    input_sequence_length: int
    request_latency: float
    output_sequence_length: int | None = None
    time_to_first_token: float | None = None
    time_to_second_token: float | None = None
    inter_token_latency: float | None = None
    output_token_throughput_per_user: float | None = None
    inter_chunk_latency: tuple[float, ...] = ()
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    usage_prompt_cache_read_tokens: int | None = None

    def value(self, tag: str) -> float | None:
        return getattr(self, tag)


def output_token_count(record: RequestRecord, count_tokens: Callable[[str], int] | None = None) -> int | None:
    """Output tokens: the server's usage.completion_tokens, else the output text re-tokenized."""
    if record.usage is not None and record.usage.completion_tokens is not None:
        return record.usage.completion_tokens
    if count_tokens is not None:
        return count_tokens(record.output_text)
    return None


def record_metrics(record: RequestRecord, output_tokens: int | None) -> RecordMetrics:
    start, chunks = record.start_perf_ns, record.chunk_perf_ns
    streamed = record.streamed and bool(chunks)
    end = chunks[-1] if streamed else (record.end_perf_ns or start)
    latency = (end - start) / NS_PER_MS
    ttft = (chunks[0] - start) / NS_PER_MS if streamed else None
    ttst = (chunks[1] - chunks[0]) / NS_PER_MS if streamed and len(chunks) > 1 else None
    gaps = tuple((b - a) / NS_PER_MS for a, b in zip(chunks, chunks[1:])) if streamed else ()
    itl = per_user = None
    if ttft is not None and output_tokens is not None and output_tokens >= 2:
        itl = (latency - ttft) / (output_tokens - 1)
        per_user = 1000.0 / itl if itl > 0 else None
    usage = record.usage
    return RecordMetrics(
        record.input_tokens, latency, output_tokens, ttft, ttst, itl, per_user, gaps,
        usage.prompt_tokens if usage else None, usage.completion_tokens if usage else None,
        usage.cached_tokens if usage else None)


@dataclass(frozen=True)
class MetricResult:
    """One metric of a run in AIPerf's JSON shape: a distribution (record metrics) or a single `avg`."""

    tag: str
    header: str
    unit: str
    avg: float | int
    min: float | None = None
    max: float | None = None
    sum: float | None = None
    p1: float | None = None
    p5: float | None = None
    p10: float | None = None
    p25: float | None = None
    p50: float | None = None
    p75: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    std: float | None = None
    count: int | None = None

    @property
    def is_distribution(self) -> bool:
        return self.count is not None

    def stat(self, key: str) -> float | None:
        return getattr(self, key)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (q in [0, 1]) by linear interpolation, as numpy and AIPerf; nan for no values."""
    return float(np.quantile(np.asarray(values, dtype=np.float64), q)) if len(values) else float("nan")


def distribution(tag: str, values: Sequence[float]) -> MetricResult | None:
    """avg, min, max, sum, p1…p99 (linear interpolation, as numpy and AIPerf) and the population std."""
    if not values:
        return None
    header, unit, _ = METRIC_INFO[tag]
    arr = np.asarray(values, dtype=np.float64)
    pct = dict(zip((f"p{p}" for p in PERCENTILES), (float(x) for x in np.percentile(arr, PERCENTILES))))
    return MetricResult(tag, header, unit, float(arr.mean()), float(arr.min()), float(arr.max()), float(arr.sum()),
                        std=float(arr.std()), count=len(arr), **pct)


def scalar(tag: str, value: float | int) -> MetricResult:
    """A single value; counts and ns timestamps stay ints (a float would round a 19-digit timestamp)."""
    header, unit, _ = METRIC_INFO[tag]
    return MetricResult(tag, header, unit, value)


@dataclass(frozen=True)
class SLO:
    """A per-request objective: `time_to_first_token:200` means TTFT ≤ 200 ms; throughput objectives are ≥."""

    tag: str
    threshold: float

    @classmethod
    def parse(cls, text: str) -> "SLO":
        tag, sep, value = text.partition(":")
        if not sep or tag not in RecordMetrics.__dataclass_fields__ or tag in ("inter_chunk_latency",):
            allowed = "time_to_first_token, time_to_second_token, inter_token_latency, request_latency, " \
                      "output_token_throughput_per_user"
            raise ValueError(f"bad SLO {text!r}: write METRIC:VALUE with METRIC one of {allowed}")
        return cls(tag, float(value))

    def met(self, metrics: RecordMetrics) -> bool:
        value = metrics.value(self.tag)
        if value is None:
            return False  # a request without the measured quantity cannot show it met the objective
        larger_is_better = METRIC_INFO[self.tag][2]
        return value >= self.threshold if larger_is_better else value <= self.threshold


def is_good(metrics: RecordMetrics, slos: Sequence[SLO]) -> bool:
    """Good only if every SLO is met."""
    return all(slo.met(metrics) for slo in slos)
