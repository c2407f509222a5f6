"""Result files in AIPerf's layout, the console table and the sweep plot, from hand-made records."""
from __future__ import annotations

import csv
import json

import pytest

from loadtests.console import render_run, render_sweep
from loadtests.export import CSV_NAME, JSON_NAME, JSONL_NAME, write_exports
from loadtests.metrics import SLO, STAT_KEYS
from loadtests.plot import plot_sweep
from loadtests.summary import summarize
from tests.test_loadtests_metrics import failed, streamed


@pytest.fixture
def run():
    warm = streamed(9, 0, [10, 20], 2)
    warm.phase = "warmup"
    records = [warm, streamed(0, 100, [100, 130, 170, 220], 5, cached=16), streamed(1, 110, [90, 150], 2),
               failed(2, 120, 503)]
    summary = summarize(records, [SLO.parse("time_to_first_token:95")], client_cpu_s=0.012)
    return records, summary


def write(tmp_path, run):
    records, summary = run
    return write_exports(tmp_path, summary, records, {"endpoint": {"type": "chat"}}, {"run_label": "concurrency2"},
                         records[1].start_ns, records[-1].end_ns, False)


def test_summary_json_has_aiperf_metric_blocks(tmp_path, run):
    write(tmp_path, run)
    doc = json.loads((tmp_path / JSON_NAME).read_text())
    assert doc["schema_version"].startswith("1.")
    ttft = doc["time_to_first_token"]
    assert ttft["unit"] == "ms" and ttft["count"] == 2
    assert set(STAT_KEYS) <= set(ttft)
    assert ttft["min"] == pytest.approx(90) and ttft["max"] == pytest.approx(100)
    # derived and aggregate metrics carry only unit and avg
    assert doc["request_count"] == {"unit": "requests", "avg": 2}
    assert doc["error_request_count"] == {"unit": "requests", "avg": 1}
    assert set(doc["request_throughput"]) == {"unit", "avg"}
    assert doc["good_request_count"]["avg"] == 1  # only the 90 ms TTFT meets 95 ms
    assert doc["total_usage_prompt_cache_read_tokens"]["avg"] == 16
    assert doc["error_summary"] == [{"error_details": {"code": 503, "type": "HTTPError", "message": "HTTP 503: boom"},
                                     "count": 1}]
    assert doc["run_info"]["run_label"] == "concurrency2" and doc["client_cpu"]["cpu_s"] == pytest.approx(0.012)
    assert doc["input_config"] == {"endpoint": {"type": "chat"}} and doc["was_cancelled"] is False


def test_jsonl_has_one_record_per_request_failed_and_warmup_included(tmp_path, run):
    write(tmp_path, run)
    lines = [json.loads(line) for line in (tmp_path / JSONL_NAME).read_text().splitlines()]
    assert [line["metadata"]["benchmark_phase"] for line in lines] == ["warmup", "profiling", "profiling", "profiling"]
    ok = lines[1]
    assert ok["error"] is None
    assert ok["metrics"]["time_to_first_token"] == {"value": pytest.approx(100), "unit": "ms"}
    assert ok["metrics"]["inter_chunk_latency"]["value"] == pytest.approx([30, 40, 50])
    assert ok["metadata"]["request_end_ns"] - ok["metadata"]["request_start_ns"] == 222 * 1_000_000
    bad = lines[3]
    assert bad["error"]["code"] == 503 and bad["metrics"] == {"error_isl": {"value": 100, "unit": "tokens"}}


def test_csv_has_aiperf_two_sections(tmp_path, run):
    write(tmp_path, run)
    rows = list(csv.reader((tmp_path / CSV_NAME).read_text().splitlines()))
    assert rows[0] == ["Metric", *STAT_KEYS]
    blank = rows.index([])
    table = {r[0]: r for r in rows[1:blank]}
    assert table["Time to First Token (ms)"][1:4] == ["95", "90", "100"]  # avg, min, max
    assert rows[blank + 1] == ["Metric", "Value"]
    singles = dict(rows[blank + 2:])
    assert singles["Request Count"] == "2" and singles["Error Request Count"] == "1"


def test_console_table_reports_errors_next_to_latencies(run):
    _, summary = run
    text = render_run(summary, "title")
    assert "Time to First Token (ms)" in text and "Requests: 2 ok, 1 failed" in text
    assert "1 × HTTPError (503): HTTP 503: boom" in text and "Client CPU: 0.01 s (4.00 ms per request" in text
    assert "concurrency2" in render_sweep([("concurrency2", summary)])


def test_sweep_plot_is_a_png(tmp_path, run):
    _, summary = run
    path = plot_sweep([("concurrency1", summary), ("concurrency2", summary)], tmp_path / "sweep.png", "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
