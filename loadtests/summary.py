"""A run's statistics: distributions of the per-request metrics, throughputs, goodput and the error summary."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from loadtests.metrics import (
    SLO, MetricResult, RecordMetrics, distribution, is_good, output_token_count, record_metrics, scalar,
)
from loadtests.records import ErrorDetails, RequestRecord

DISTRIBUTIONS = ("time_to_first_token", "time_to_second_token", "request_latency", "inter_token_latency",
                 "inter_chunk_latency", "output_token_throughput_per_user", "output_sequence_length",
                 "input_sequence_length", "usage_prompt_tokens", "usage_completion_tokens",
                 "usage_prompt_cache_read_tokens")


@dataclass
class RunSummary:
    results: dict[str, MetricResult]
    error_summary: list[tuple[ErrorDetails, int]]
    record_metrics: list[tuple[RequestRecord, RecordMetrics | None]]  # profiling records; None for failed ones
    slos: list[SLO] = field(default_factory=list)
    client_cpu_s: float | None = None

    def value(self, tag: str, stat: str = "avg") -> float | None:
        result = self.results.get(tag)
        return result.stat(stat) if result is not None else None

    @property
    def request_count(self) -> int:
        return int(self.value("request_count") or 0)

    @property
    def error_count(self) -> int:
        return int(self.value("error_request_count") or 0)

    @property
    def client_cpu_ms_per_request(self) -> float | None:
        sent = len(self.record_metrics)
        return self.client_cpu_s * 1000.0 / sent if self.client_cpu_s is not None and sent else None


def summarize(records: Sequence[RequestRecord], slos: Sequence[SLO] = (),
              count_tokens: Callable[[str], int] | None = None, client_cpu_s: float | None = None) -> RunSummary:
    """Statistics of the profiling records (warm-up ones are left out here, never failed ones)."""
    records = [r for r in records if r.phase == "profiling"]
    pairs: list[tuple[RequestRecord, RecordMetrics | None]] = [
        (r, record_metrics(r, output_token_count(r, count_tokens)) if r.ok else None) for r in records]
    good_metrics = [m for _, m in pairs if m is not None]
    results: dict[str, MetricResult] = {}
    for tag in DISTRIBUTIONS:
        if tag == "inter_chunk_latency":
            values = [gap for m in good_metrics for gap in m.inter_chunk_latency]
        else:
            values = [v for m in good_metrics if (v := m.value(tag)) is not None]
        result = distribution(tag, values)
        if result is not None:
            results[tag] = result

    ok, failed = len(good_metrics), len(records) - len(good_metrics)
    results["request_count"] = scalar("request_count", ok)
    results["error_request_count"] = scalar("error_request_count", failed)
    cancelled = sum(r.cancelled for r in records)
    if cancelled:
        results["cancelled_request_count"] = scalar("cancelled_request_count", cancelled)
    if records:
        _add_throughputs(results, records, good_metrics, slos)
    errors = Counter(r.error for r in records if r.error is not None)
    return RunSummary(results, errors.most_common(), pairs, list(slos), client_cpu_s)


def _add_throughputs(results: dict[str, MetricResult], records: Sequence[RequestRecord],
                     good_metrics: list[RecordMetrics], slos: Sequence[SLO]) -> None:
    first_ns = min(r.start_ns for r in records)
    last_ns = max(r.end_ns for r in records)
    duration_s = max(last_ns - first_ns, 1) / 1e9
    total_isl = sum(m.input_sequence_length for m in good_metrics)
    total_osl = sum(m.output_sequence_length or 0 for m in good_metrics)
    ok = len(good_metrics)
    results["min_request_timestamp"] = scalar("min_request_timestamp", first_ns)
    results["max_response_timestamp"] = scalar("max_response_timestamp", last_ns)
    results["benchmark_duration"] = scalar("benchmark_duration", duration_s)
    results["total_isl"] = scalar("total_isl", total_isl)
    results["total_osl"] = scalar("total_osl", total_osl)
    results["request_throughput"] = scalar("request_throughput", ok / duration_s)
    results["output_token_throughput"] = scalar("output_token_throughput", total_osl / duration_s)
    results["total_token_throughput"] = scalar("total_token_throughput", (total_isl + total_osl) / duration_s)
    cached = [m.usage_prompt_cache_read_tokens for m in good_metrics if m.usage_prompt_cache_read_tokens is not None]
    if cached:
        results["total_usage_prompt_cache_read_tokens"] = scalar("total_usage_prompt_cache_read_tokens", sum(cached))
        prompt = sum(m.usage_prompt_tokens or 0 for m in good_metrics)
        if prompt:
            results["overall_usage_prompt_cache_read_pct"] = scalar(
                "overall_usage_prompt_cache_read_pct", 100.0 * sum(cached) / prompt)
    if slos:
        good = sum(is_good(m, slos) for m in good_metrics)
        results["good_request_count"] = scalar("good_request_count", good)
        results["good_request_fraction"] = scalar("good_request_fraction", good / len(records))
        results["goodput"] = scalar("goodput", good / duration_s)
