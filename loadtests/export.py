"""Result files in AIPerf's layout: profile_export.jsonl, profile_export_aiperf.json, profile_export_aiperf.csv.

The summary JSON follows AIPerf's documented 1.x schema (metric blocks keyed by tag at the top level; record
metrics carry the distribution and `count`, derived and aggregate ones only `avg`), so tools written for AIPerf
read it. Fields AIPerf does not have (client_cpu, the request schedule) are additions, which that schema allows.
"""
from __future__ import annotations

import csv
import io
import json
import uuid
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from loadtests.metrics import (
    METRIC_INFO, STAT_KEYS, MetricResult, RecordMetrics, output_token_count, record_metrics,
)
from loadtests.records import RequestRecord
from loadtests.summary import RunSummary

SCHEMA_VERSION = "1.3"
JSONL_NAME = "profile_export.jsonl"
JSON_NAME = "profile_export_aiperf.json"
CSV_NAME = "profile_export_aiperf.csv"


def _wall_ns(record: RequestRecord, perf_ns: int | None) -> int | None:
    return None if perf_ns is None else record.start_ns + (perf_ns - record.start_perf_ns)


def record_line(record: RequestRecord, metrics: RecordMetrics | None) -> dict[str, Any]:
    """One request in AIPerf's MetricRecordInfo shape (metadata, metrics with units, error)."""
    metadata = {
        "session_num": record.index, "x_request_id": record.request_id, "x_correlation_id": record.request_id,
        "conversation_id": str(record.index), "turn_index": 0, "request_start_ns": record.start_ns,
        "request_ack_ns": _wall_ns(record, record.ack_perf_ns), "request_end_ns": record.end_ns,
        "worker_id": "loadtests", "record_processor_id": "loadtests", "benchmark_phase": record.phase,
        "was_cancelled": record.cancelled, "cancellation_time_ns": record.end_ns if record.cancelled else None,
        "requested_output_tokens": record.max_tokens, "finish_reason": record.finish_reason,
        "scheduled_offset_s": record.scheduled_offset_s,
    }
    values: dict[str, Any] = {}
    if metrics is None:
        values["error_isl"] = {"value": record.input_tokens, "unit": "tokens"}
    else:
        for tag, value in asdict(metrics).items():
            if value is None or (tag == "inter_chunk_latency" and not value):
                continue
            values[tag] = {"value": list(value) if isinstance(value, tuple) else value, "unit": METRIC_INFO[tag][1]}
    error = asdict(record.error) if record.error is not None else None
    return {"metadata": metadata, "metrics": values, "error": error}


def write_jsonl(f: TextIO, pairs: list[tuple[RequestRecord, RecordMetrics | None]]) -> None:
    for record, metrics in pairs:
        f.write(json.dumps(record_line(record, metrics)) + "\n")


def _metric_block(result: MetricResult) -> dict[str, Any]:
    block: dict[str, Any] = {"unit": result.unit, "avg": result.avg}
    if result.is_distribution:
        block.update({k: result.stat(k) for k in STAT_KEYS if k != "avg"})
        block["count"] = result.count
    return block


def summary_json(summary: RunSummary, input_config: dict[str, Any], run_info: dict[str, Any],
                 start_ns: int, end_ns: int, was_cancelled: bool) -> dict[str, Any]:
    iso = lambda ns: datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat()  # noqa: E731
    benchmark_id = run_info.get("benchmark_id") or uuid.uuid4().hex
    doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "benchmark_id": benchmark_id}
    doc.update({tag: _metric_block(result) for tag, result in summary.results.items()})
    doc.update({
        "start_time": iso(start_ns), "end_time": iso(end_ns), "was_cancelled": was_cancelled,
        "input_config": input_config, "run_info": {**run_info, "benchmark_id": benchmark_id},
        "error_summary": [{"error_details": asdict(e), "count": n} for e, n in summary.error_summary],
    })
    if summary.client_cpu_s is not None:
        doc["client_cpu"] = {"cpu_s": summary.client_cpu_s,
                             "cpu_ms_per_request": summary.client_cpu_ms_per_request,
                             "cores": summary.client_cpu_s / max(summary.value("benchmark_duration") or 1e-9, 1e-9)}
    if summary.slos:
        doc["goodput_slos"] = {slo.tag: slo.threshold for slo in summary.slos}
    return doc


def _metric_name(result: MetricResult) -> str:
    unit = result.unit
    return result.header if unit.lower() in ("count", "requests") else f"{result.header} ({unit})"


def _number(value: float | int | None) -> str:
    if value is None:
        return ""
    if float(value).is_integer():
        return str(int(value))
    return f"{float(value):.2f}"


def summary_csv(summary: RunSummary) -> str:
    """AIPerf's two sections: distributions (one row per metric, a column per statistic), then single values."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    dists = sorted((r for r in summary.results.values() if r.is_distribution), key=lambda r: r.tag)
    singles = sorted((r for r in summary.results.values() if not r.is_distribution), key=lambda r: r.tag)
    if dists:
        writer.writerow(["Metric", *STAT_KEYS])
        for r in dists:
            writer.writerow([_metric_name(r), *(_number(r.stat(k)) for k in STAT_KEYS)])
        if singles:
            writer.writerow([])
    if singles:
        writer.writerow(["Metric", "Value"])
        for r in singles:
            writer.writerow([_metric_name(r), _number(r.avg)])
    return buf.getvalue()


def write_exports(out_dir: Path, summary: RunSummary, all_records: list[RequestRecord], input_config: dict[str, Any],
                  run_info: dict[str, Any], start_ns: int, end_ns: int, was_cancelled: bool) -> list[Path]:
    """All three files; warm-up requests appear in the JSONL (benchmark_phase "warmup"), not in the statistics."""
    out_dir.mkdir(parents=True, exist_ok=True)
    measured = {id(r): m for r, m in summary.record_metrics}
    pairs = [(r, measured[id(r)] if id(r) in measured else
              record_metrics(r, output_token_count(r)) if r.ok else None) for r in all_records]
    with open(out_dir / JSONL_NAME, "w", encoding="utf-8") as f:
        write_jsonl(f, pairs)
    doc = summary_json(summary, input_config, run_info, start_ns, end_ns, was_cancelled)
    (out_dir / JSON_NAME).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    (out_dir / CSV_NAME).write_text(summary_csv(summary), encoding="utf-8")
    return [out_dir / JSONL_NAME, out_dir / JSON_NAME, out_dir / CSV_NAME]
