"""What a simulated run delivered and what it cost: latency percentiles, goodput under SLOs, replica-seconds.

Latencies follow AIPerf's definitions, as loadtests/ reports them: time to first token from arrival, inter-token
latency per request (last token - first token) / (output tokens - 1). A request is good when it finished and
met every SLO; goodput is good requests per second of the run, and attainment the share of requests that were
good. A window (`start_s`, `end_s`) counts only the requests that arrived in it and the replica-seconds spent in
it: a run may start earlier, so that every policy meets the window's load already settled.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from autoscaling.capacity import SLO
from autoscaling.simulator import SimResult




@dataclass(frozen=True)
class Summary:
    policy: str
    requests: int
    finished: int
    failed: int
    duration_s: float
    output_tok_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p90_s: float
    itl_p99_s: float
    good_requests: int
    goodput_rps: float
    attainment: float  # good requests / requests
    replica_seconds: float
    mean_replicas: float
    max_replicas: int
    preemptions: int

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(result: SimResult, slo: SLO, start_s: float = 0.0, end_s: float | None = None) -> Summary:
    end_s = result.duration_s if end_s is None else end_s
    requests = [r for r in result.requests if start_s <= r.spec.arrival_s < end_s]
    done = [r for r in requests if r.finish_s is not None]
    ttft = np.array([r.first_token_s - r.spec.arrival_s for r in done])
    itl = np.array([(r.last_token_s - r.first_token_s) / (r.output_done - 1) for r in done if r.output_done > 1])
    good = sum(1 for r in done if r.first_token_s - r.spec.arrival_s <= slo.ttft_s
               and (r.output_done <= 1 or (r.last_token_s - r.first_token_s) / (r.output_done - 1) <= slo.itl_s))
    whole = start_s <= 0 and end_s >= result.duration_s
    replica_seconds = result.replica_seconds if whole else replica_seconds_between(result, start_s, end_s)
    points = [p for p in result.timeline if start_s <= p.t <= end_s]
    duration = max(end_s - start_s, 1e-9)
    return Summary(
        policy=result.policy, requests=len(requests), finished=len(done), failed=len(requests) - len(done),
        duration_s=duration, output_tok_s=sum(r.output_done for r in done) / duration,
        ttft_p50_s=_pct(ttft, 50), ttft_p90_s=_pct(ttft, 90), ttft_p99_s=_pct(ttft, 99),
        itl_p50_s=_pct(itl, 50), itl_p90_s=_pct(itl, 90), itl_p99_s=_pct(itl, 99),
        good_requests=good, goodput_rps=good / duration, attainment=good / max(len(requests), 1),
        replica_seconds=replica_seconds, mean_replicas=replica_seconds / duration,
        max_replicas=max((p.running + p.starting + p.draining for p in points), default=result.max_replicas_seen),
        preemptions=sum(r.preemptions for r in requests))


def replica_seconds_between(result: SimResult, start_s: float, end_s: float) -> float:
    """Replicas alive (starting, running or draining) integrated over [start_s, end_s], from the timeline."""
    total = 0.0
    for point, following in zip(result.timeline, result.timeline[1:]):
        left, right = max(point.t, start_s), min(following.t, end_s)
        if right > left:
            total += (right - left) * (point.running + point.starting + point.draining)
    return total


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def table(summaries: list[Summary]) -> str:
    width = max([len(s.policy) for s in summaries] + [6])
    head = (f"{'policy':{width}} {'good':>5} {'goodput/s':>9} {'fail':>4} {'TTFT p50':>8} {'p99':>7} {'ITL p50':>7} "
            f"{'p99':>6} {'out tok/s':>9} {'replica-s':>9} {'mean':>5} {'max':>3}")
    lines = [head]
    for s in summaries:
        lines.append(f"{s.policy:{width}} {s.good_requests:5d} {s.goodput_rps:9.3f} {s.failed:4d} {s.ttft_p50_s:8.2f} "
                     f"{s.ttft_p99_s:7.2f} {s.itl_p50_s * 1000:6.0f}m {s.itl_p99_s * 1000:5.0f}m "
                     f"{s.output_tok_s:9.1f} {s.replica_seconds:9.0f} {s.mean_replicas:5.2f} {s.max_replicas:3d}")
    return "\n".join(lines)


def plot(results: list[SimResult], slo: SLO, path: str | Path, title: str = "") -> None:
    """Replicas over time (target and alive) and the load, one row per policy, plus TTFT of each request."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results) + 1, 1, figsize=(11, 2.6 * (len(results) + 1)), sharex=True)
    for ax, result in zip(axes, results):
        t = [p.t for p in result.timeline]
        ax.step(t, [p.running + p.starting + p.draining for p in result.timeline], where="post", label="alive")
        ax.step(t, [p.running for p in result.timeline], where="post", label="running")
        ax.set_ylabel("replicas")
        twin = ax.twinx()
        twin.plot(t, [p.waiting for p in result.timeline], color="tab:red", alpha=0.4, lw=0.8, label="waiting")
        twin.plot(t, [p.kv_usage * 100 for p in result.timeline], color="tab:green", alpha=0.4, lw=0.8,
                  label="KV %")
        twin.set_ylabel("waiting / KV %")
        ax.set_title(f"{result.policy}: {result.replica_seconds:.0f} replica-s", fontsize=9, loc="left")
        ax.legend(loc="upper left", fontsize=7)
        twin.legend(loc="upper right", fontsize=7)
    ax = axes[-1]
    for result in results:
        done = [r for r in result.requests if r.finish_s is not None]
        ax.scatter([r.spec.arrival_s for r in done], [r.first_token_s - r.spec.arrival_s for r in done], s=2,
                   alpha=0.5, label=result.policy)
    ax.axhline(slo.ttft_s, color="black", lw=0.8, ls="--", label=f"TTFT SLO {slo.ttft_s:g} s")
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (s)")
    ax.set_xlabel("time (s)")
    ax.legend(fontsize=7, markerscale=4)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
