"""The benchmark runner and the Locust users against the real app, each as the command a user would type."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.datasets import MOONCAKE_TRACE

pytestmark = [pytest.mark.slow, pytest.mark.serve]

REPO = Path(__file__).parents[1]
FILES = ("profile_export.jsonl", "profile_export_aiperf.json", "profile_export_aiperf.csv", "sweep.png", "sweep.json")


def bench(serve_app, out: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "loadtests.bench", "--url", serve_app.base_url, "--model", serve_app.model,
           "--artifact-dir", str(out), "--no-progress", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines()]


def test_benchmark_at_concurrency_4_finishes_without_errors_and_writes_every_file(serve_app, tmp_path):
    out = tmp_path / "bench"
    proc = bench(serve_app, out, "--concurrency", "4", "--num-requests", "20", "--warmup-requests", "2",
                 "--isl", "64", "--osl", "16", "--ignore-eos",
                 "--goodput", "time_to_first_token:60000 inter_token_latency:10000")
    assert all((out / name).stat().st_size > 0 for name in FILES)
    doc = json.loads((out / "profile_export_aiperf.json").read_text())
    assert doc["request_count"]["avg"] == 20 and doc["error_request_count"]["avg"] == 0
    assert doc["time_to_first_token"]["count"] == 20 and doc["inter_token_latency"]["count"] == 20
    assert doc["input_sequence_length"]["avg"] == 64 and doc["output_sequence_length"]["avg"] == 16  # from usage
    assert doc["good_request_count"]["avg"] == 20  # SLOs far above anything this run can take
    assert doc["client_cpu"]["cpu_ms_per_request"] > 0
    lines = records(out)
    assert [r["metadata"]["benchmark_phase"] for r in lines].count("warmup") == 2 and len(lines) == 22
    assert all(r["error"] is None and r["metrics"]["usage_completion_tokens"]["value"] == 16 for r in lines)
    assert "Time to First Token (ms)" in proc.stdout and "Requests: 20 ok, 0 failed" in proc.stdout


def test_locust_headless_run_records_ttft_without_failures(serve_app, tmp_path):
    cmd = [sys.executable, "-m", "locust", "-f", "loadtests/locustfile.py", "--headless", "-u", "4", "-r", "4",
           "-t", "15s", "--stop-timeout", "60", "--host", serve_app.base_url, "--model", serve_app.model,
           "--csv", str(tmp_path / "locust"), "--html", str(tmp_path / "report.html"),
           "--records-jsonl", str(tmp_path / "records.jsonl"), "--isl", "32", "--osl", "16", "--ignore-eos",
           "--only-summary", "ChatUser"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # Locust exits 1 when any request failed
    with open(tmp_path / "locust_stats.csv") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    post = rows[("POST", "/v1/chat/completions")]
    assert int(post["Request Count"]) > 0 and int(post["Failure Count"]) == 0
    ttft = rows[("METRIC", "time_to_first_token")]
    assert int(ttft["Request Count"]) > 0 and float(ttft["Average Response Time"]) > 0
    assert int(rows[("METRIC", "output_tokens")]["Median Response Time"]) == 16
    exact = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(exact) >= int(post["Request Count"])
    assert all(r["error"] is None and r["metrics"]["time_to_first_token"]["value"] > 0 for r in exact)
    assert (tmp_path / "report.html").stat().st_size > 0


def test_mooncake_replay_keeps_the_trace_schedule_and_reports_prefix_cache_hits(serve_app, tmp_path):
    out = tmp_path / "replay"
    bench(serve_app, out, "--dataset", "trace", "--trace", str(MOONCAKE_TRACE), "--num-requests", "30",
          "--block-size", "8", "--time-scale", "0.5", "--max-output-tokens", "4")
    doc = json.loads((out / "profile_export_aiperf.json").read_text())
    assert doc["request_count"]["avg"] == 30 and doc["error_request_count"]["avg"] == 0
    assert doc["total_usage_prompt_cache_read_tokens"]["avg"] > 0  # the server's usage.prompt_tokens_details
    lines = sorted(records(out), key=lambda r: r["metadata"]["request_start_ns"])
    assert [r["metadata"]["session_num"] for r in lines] == list(range(30))  # sent in trace order
    trace = [json.loads(line) for line in MOONCAKE_TRACE.read_text().splitlines()[:30]]
    t0 = lines[0]["metadata"]["request_start_ns"]
    for r, row in zip(lines, trace):
        wanted = (row["timestamp"] - trace[0]["timestamp"]) / 1000 * 0.5
        assert r["metadata"]["scheduled_offset_s"] == pytest.approx(wanted)
        assert (r["metadata"]["request_start_ns"] - t0) / 1e9 == pytest.approx(wanted, abs=0.3)


def test_requests_running_past_the_deadline_are_cancelled_and_counted(serve_app, tmp_path):
    out = tmp_path / "cut"
    proc = bench(serve_app, out, "--concurrency", "2", "--duration", "1.5", "--grace-period", "0", "--isl", "16",
                 "--osl", "400", "--ignore-eos")
    doc = json.loads((out / "profile_export_aiperf.json").read_text())
    assert doc["was_cancelled"] is True
    assert doc["request_count"]["avg"] == 0 and doc["error_request_count"]["avg"] == 2
    assert doc["cancelled_request_count"]["avg"] == 2 and doc["error_summary"][0]["error_details"]["code"] == 499
    assert len(records(out)) == 2 and "0 ok, 2 failed (2 cancelled)" in proc.stdout
