"""Benchmark metrics against records whose answers were worked out by hand (AIPerf's definitions)."""
from __future__ import annotations

import math

import pytest

from loadtests.metrics import SLO, distribution, is_good, output_token_count, record_metrics
from loadtests.records import ErrorDetails, RequestRecord, Usage
from loadtests.summary import summarize

MS = 1_000_000  # ns


def streamed(index: int, start_ms: float, chunk_ms: list[float], completion_tokens: int | None,
             cached: int | None = None, input_tokens: int = 100) -> RequestRecord:
    """A streamed request that started at start_ms (wall and perf clocks agree here) with content chunks at chunk_ms."""
    start = int(start_ms * MS)
    usage = Usage(input_tokens, completion_tokens, None, cached) if completion_tokens is not None else None
    return RequestRecord(f"r{index}", index, "profiling", input_tokens, 16, start, start, ack_perf_ns=start + MS,
                         chunk_perf_ns=[start + int(t * MS) for t in chunk_ms], chunk_chars=[3] * len(chunk_ms),
                         end_perf_ns=start + int((chunk_ms[-1] + 2) * MS), output_text="abc" * len(chunk_ms),
                         finish_reason="length", usage=usage)


def failed(index: int, start_ms: float, code: int = 500, cancelled: bool = False) -> RequestRecord:
    start = int(start_ms * MS)
    return RequestRecord(f"e{index}", index, "profiling", 100, 16, start, start, end_perf_ns=start + 50 * MS,
                         error=ErrorDetails(code, "HTTPError", f"HTTP {code}: boom"), cancelled=cancelled)


def test_streamed_request_metrics_follow_aiperf_definitions():
    record = streamed(0, 0, [100, 130, 170, 220], completion_tokens=5, cached=32)
    m = record_metrics(record, output_token_count(record))
    assert m.time_to_first_token == pytest.approx(100)  # first content chunk − start
    assert m.time_to_second_token == pytest.approx(30)  # second − first content chunk
    assert m.request_latency == pytest.approx(220)  # last content chunk − start, not the trailing [DONE]
    assert m.inter_token_latency == pytest.approx((220 - 100) / (5 - 1))  # 30 ms: tokens, not chunks
    assert m.output_token_throughput_per_user == pytest.approx(1000 / 30)
    assert m.inter_chunk_latency == pytest.approx((30, 40, 50))
    assert (m.output_sequence_length, m.usage_prompt_cache_read_tokens) == (5, 32)


def test_output_tokens_come_from_usage_and_else_from_the_tokenizer():
    with_usage = streamed(0, 0, [10, 20], completion_tokens=7)
    without = streamed(1, 0, [10, 20], completion_tokens=None)
    count = lambda text: len(text) // 3  # noqa: E731  one "token" per 3 characters of this output
    assert output_token_count(with_usage, count) == 7
    assert output_token_count(without, count) == 2
    assert output_token_count(without) is None


def test_inter_token_latency_needs_two_output_tokens():
    m = record_metrics(streamed(0, 0, [40], completion_tokens=1), 1)
    assert m.time_to_first_token == pytest.approx(40) and m.inter_token_latency is None
    assert m.time_to_second_token is None and m.inter_chunk_latency == ()


def test_percentiles_and_stats_match_hand_computation():
    r = distribution("request_latency", [10.0, 20.0, 30.0, 40.0, 50.0])
    # linear interpolation between closest ranks: p = 10 + (50−10)·q
    assert (r.p1, r.p25, r.p50, r.p90, r.p99) == pytest.approx((10.4, 20.0, 30.0, 46.0, 49.6))
    assert (r.avg, r.min, r.max, r.sum, r.count) == pytest.approx((30.0, 10.0, 50.0, 150.0, 5))
    assert r.std == pytest.approx(math.sqrt(200.0))  # population std: mean squared deviation (400+100+0+100+400)/5
    assert distribution("request_latency", []) is None


def test_goodput_counts_requests_that_meet_both_slos():
    slos = [SLO.parse("time_to_first_token:200"), SLO.parse("inter_token_latency:50")]
    records = [
        streamed(0, 0, [150, 190, 230], 3),  # TTFT 150, ITL 40: good
        streamed(1, 100, [250, 290, 330], 3),  # TTFT 250: misses TTFT
        streamed(2, 200, [150, 210, 270], 3),  # ITL 60: misses ITL
        streamed(3, 300, [200, 250, 300], 3),  # TTFT 200, ITL 50: thresholds are inclusive, good
        failed(4, 400),  # an error is never good, and still counts as attempted
    ]
    summary = summarize(records, slos)
    # duration: first start 0 ms → last byte: record 3 ends at 300 + 300 + 2 = 602 ms
    assert summary.value("benchmark_duration") == pytest.approx(0.602)
    assert summary.value("good_request_count") == 2
    assert summary.value("good_request_fraction") == pytest.approx(2 / 5)
    assert summary.value("goodput") == pytest.approx(2 / 0.602)
    assert summary.value("request_throughput") == pytest.approx(4 / 0.602)
    assert summary.value("output_token_throughput") == pytest.approx(12 / 0.602)


def test_throughput_slo_means_at_least():
    slo = SLO.parse("output_token_throughput_per_user:20")
    fast = record_metrics(streamed(0, 0, [10, 40, 70], 3), 3)  # ITL 30 ms → 33 tok/s
    slow = record_metrics(streamed(1, 0, [10, 70, 130], 3), 3)  # ITL 60 ms → 16.7 tok/s
    assert is_good(fast, [slo]) and not is_good(slow, [slo])


@pytest.mark.parametrize("text", ["ttft:200", "time_to_first_token", "inter_chunk_latency:5"])
def test_unknown_or_malformed_slos_are_refused(text):
    with pytest.raises(ValueError, match="METRIC:VALUE"):
        SLO.parse(text)


def test_failed_and_cancelled_requests_are_counted_never_dropped():
    records = [streamed(0, 0, [100, 150], 2), failed(1, 10, 503), failed(2, 20, 503),
               failed(3, 30, 499, cancelled=True)]
    summary = summarize(records)
    assert (summary.request_count, summary.error_count) == (1, 3)
    assert summary.value("cancelled_request_count") == 1
    assert sorted((e.code, n) for e, n in summary.error_summary) == [(499, 1), (503, 2)]
    assert len(summary.record_metrics) == 4  # every request, with no metrics for the failed ones
    assert summary.value("time_to_first_token", "count") == 1


def test_warmup_requests_are_left_out_of_the_statistics():
    warm = streamed(0, 0, [5000, 5100], 2)
    warm.phase = "warmup"
    summary = summarize([warm, streamed(1, 10, [100, 200], 2)])
    assert summary.request_count == 1 and summary.value("time_to_first_token") == pytest.approx(100)
