"""The console table of a run, and the one-line-per-point table of a sweep."""
from __future__ import annotations

from loadtests.summary import RunSummary

TABLE_STATS = ("avg", "min", "max", "p99", "p90", "p50", "std")
TABLE_DISTRIBUTIONS = ("time_to_first_token", "time_to_second_token", "request_latency", "inter_token_latency",
                       "inter_chunk_latency", "output_token_throughput_per_user", "output_sequence_length",
                       "input_sequence_length", "usage_prompt_cache_read_tokens")
TABLE_SINGLES = ("request_throughput", "output_token_throughput", "total_token_throughput", "goodput",
                 "good_request_count", "overall_usage_prompt_cache_read_pct", "benchmark_duration")


def _fmt(value: float | int | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.0f}" if abs(value) >= 10_000 else f"{value:,.2f}"


def _name(header: str, unit: str) -> str:
    return header if header.endswith(unit) else f"{header} ({unit})"


def render_run(summary: RunSummary, title: str) -> str:
    rows = [(_name(r.header, r.unit), [_fmt(r.stat(k)) for k in TABLE_STATS])
            for tag in TABLE_DISTRIBUTIONS if (r := summary.results.get(tag)) is not None]
    width = max([len(name) for name, _ in rows] + [40])
    lines = [title, f"{'Metric':<{width}}" + "".join(f"{k:>11}" for k in TABLE_STATS)]
    lines += [f"{name:<{width}}" + "".join(f"{v:>11}" for v in values) for name, values in rows]
    for tag in TABLE_SINGLES:
        r = summary.results.get(tag)
        if r is not None:
            lines.append(f"{_name(r.header, r.unit):<{width}}{_fmt(r.avg):>11}")
    cancelled = int(summary.value("cancelled_request_count") or 0)
    lines.append(f"Requests: {summary.request_count} ok, {summary.error_count} failed ({cancelled} cancelled)")
    for error, count in summary.error_summary:
        lines.append(f"  {count} × {error.type} ({error.code}): {error.message}")
    if summary.slos:
        lines.append("Goodput SLOs: " + ", ".join(f"{s.tag} {'≥' if 'throughput' in s.tag else '≤'} {s.threshold:g}"
                                                  for s in summary.slos))
    if summary.client_cpu_s is not None:
        duration = summary.value("benchmark_duration") or 0.0
        per_request = summary.client_cpu_ms_per_request
        lines.append(f"Client CPU: {summary.client_cpu_s:.2f} s"
                     + (f" ({per_request:.2f} ms per request" if per_request is not None else " (")
                     + (f", {summary.client_cpu_s / duration:.3f} of a core)" if duration else ")"))
    return "\n".join(lines)


def render_sweep(points: list[tuple[str, RunSummary]]) -> str:
    header = f"{'point':<34}{'ok':>6}{'err':>5}{'req/s':>9}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}" \
             f"{'ITL p50':>9}{'ITL p99':>9}{'goodput':>9}"
    lines = [header]
    for label, s in points:
        lines.append(f"{label:<34}{s.request_count:>6}{s.error_count:>5}{_fmt(s.value('request_throughput')):>9}"
                     f"{_fmt(s.value('output_token_throughput')):>11}"
                     f"{_fmt(s.value('time_to_first_token', 'p50')):>10}{_fmt(s.value('time_to_first_token', 'p99')):>10}"
                     f"{_fmt(s.value('inter_token_latency', 'p50')):>9}{_fmt(s.value('inter_token_latency', 'p99')):>9}"
                     f"{_fmt(s.value('goodput')):>9}")
    return "\n".join(lines)
