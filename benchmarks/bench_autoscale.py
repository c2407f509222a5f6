"""Autoscaling policies on the Mooncake trace, simulated: goodput under SLOs against replica-seconds.

The whole trace (about 4,000 requests over 17 minutes) at 8 tokens per hash id, on its own clock, against
simulated engine replicas timed by the recorded profile (SmolLM2-135M, one CPU each, serve_config.yaml's KV pool),
with AppArgs' default Serve delays, at most `--max-replicas` replicas for every policy. Serve's default policy
runs at several `target_ongoing_requests` (2 is Serve's own default), which traces the goodput it buys for each
replica-second; the queue + KV policy runs with its defaults, and with tighter waiting marks (1.5 / 0.5) to
show what more goodput costs. Each policy runs with `--seeds` routing seeds and is reported as their mean.

The headline compares at equal goodput: the replica-seconds Serve's policy needs for the goodput ours reached,
read off its curve (the cheapest target that reaches it, interpolated between neighbours), against ours; and at
equal replica-seconds, the goodput its curve gives for ours.

    python -m benchmarks.bench_autoscale    # the Mooncake trace kept in loadtests/traces/, or --trace FILE
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

import numpy as np

from autoscaling.policy import QueueKVConfig
from autoscaling.report import SLO, Summary, plot, summarize, table
from autoscaling.serve_rules import DEFAULT_TARGET_ONGOING_REQUESTS, ServeAutoscalingConfig
from autoscaling.simulator import ClusterConfig, OngoingRequestsPolicy, QueueKVSimPolicy, SimResult, simulate
from autoscaling.step_model import DEFAULT_PROFILE, ReplicaProfile
from autoscaling.workload import TraceWorkload
from deployments.autoscaling_config import AutoscalingArgs
from loadtests.datasets import MOONCAKE_TRACE

log = logging.getLogger("bench_autoscale")

TARGETS = (2, 4, 6, 8, 12, 16, 24, 32)
TIGHT = QueueKVConfig(waiting_high=1.5, waiting_low=0.5)


def mean_summary(runs: list[Summary]) -> Summary:
    values = {}
    for f in dataclasses.fields(Summary):
        column = [getattr(r, f.name) for r in runs]
        values[f.name] = column[0] if isinstance(column[0], str) else type(column[0])(np.mean(column))
    return Summary(**values)


def replica_seconds_for(goodput: float, curve: list[Summary]) -> float | None:
    """The replica-seconds the curve needs to reach `goodput`: the cheapest point at or above it, interpolated
    from the next cheaper one; None when no point reaches it."""
    points = sorted(curve, key=lambda s: s.replica_seconds)
    best_below = None
    for point in points:
        if point.goodput_rps >= goodput:
            if best_below is None or best_below.goodput_rps >= point.goodput_rps:
                return point.replica_seconds
            share = (goodput - best_below.goodput_rps) / (point.goodput_rps - best_below.goodput_rps)
            return best_below.replica_seconds + share * (point.replica_seconds - best_below.replica_seconds)
        if best_below is None or point.goodput_rps > best_below.goodput_rps:
            best_below = point
    return None


def goodput_at(replica_seconds: float, curve: list[Summary]) -> float:
    """The best goodput the curve reaches with at most `replica_seconds`, interpolated between its points."""
    points = sorted(curve, key=lambda s: s.replica_seconds)
    xs = [p.replica_seconds for p in points]
    ys = np.maximum.accumulate([p.goodput_rps for p in points])
    return float(np.interp(replica_seconds, xs, ys))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=MOONCAKE_TRACE)
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE))
    parser.add_argument("--block-size", type=int, default=8, help="prompt tokens per trace hash id")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--max-replicas", type=int, default=8)
    parser.add_argument("--startup-s", type=float, default=15.0, help="replica asked for -> serving")
    parser.add_argument("--slo-ttft-s", type=float, default=2.0)
    parser.add_argument("--slo-itl-s", type=float, default=0.2)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default="results/bench_autoscale.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    requests = TraceWorkload(str(args.trace), args.block_size, args.time_scale).requests()
    profile = ReplicaProfile.load(args.profile)
    defaults = AutoscalingArgs()
    serve = ServeAutoscalingConfig(min_replicas=1, max_replicas=args.max_replicas,
                                   upscale_delay_s=defaults.upscale_delay_s,
                                   downscale_delay_s=defaults.downscale_delay_s,
                                   look_back_period_s=defaults.look_back_period_s,
                                   metrics_interval_s=defaults.metrics_interval_s)
    slo = SLO(args.slo_ttft_s, args.slo_itl_s)
    policies = [QueueKVSimPolicy(QueueKVConfig(), name="queue_kv"),
                QueueKVSimPolicy(TIGHT, name="queue_kv:waiting_high=1.5")] + [
        OngoingRequestsPolicy(float(t), name=f"ongoing_requests:{t}") for t in TARGETS]

    summaries: list[Summary] = []
    shown: dict[str, SimResult] = {}
    for policy in policies:
        runs = []
        for seed in range(args.seeds):
            cluster = ClusterConfig(serve=serve, startup_s=args.startup_s, seed=seed)
            result = simulate(requests, profile, policy, cluster)
            runs.append(summarize(result, slo))
            if seed == 0:
                shown[policy.name] = result
        summaries.append(mean_summary(runs))
        log.info("%s: %.3f good/s, %.0f replica-s", policy.name, summaries[-1].goodput_rps,
                 summaries[-1].replica_seconds)

    ours, tight, curve = summaries[0], summaries[1], summaries[2:]
    serve_default = next(s for s in curve if s.policy == f"ongoing_requests:{DEFAULT_TARGET_ONGOING_REQUESTS:g}")
    needed = replica_seconds_for(ours.goodput_rps, curve)
    saving = None if needed is None else 1 - ours.replica_seconds / needed
    gain = ours.goodput_rps / goodput_at(ours.replica_seconds, curve) - 1
    print(f"\n{len(requests)} requests over {requests[-1].arrival_s:.0f} s, {profile.name}, "
          f"at most {args.max_replicas} replicas, SLO TTFT <= {slo.ttft_s:g} s and ITL <= {slo.itl_s * 1000:g} ms, "
          f"mean of {args.seeds} seeds")
    print(table(summaries))
    print(f"\nqueue_kv against Serve's default policy (target {DEFAULT_TARGET_ONGOING_REQUESTS:g}): "
          f"{ours.goodput_rps / serve_default.goodput_rps:.1%} of its goodput with "
          f"{1 - ours.replica_seconds / serve_default.replica_seconds:.1%} fewer replica-seconds")
    if saving is not None:
        print(f"at equal goodput ({ours.goodput_rps:.3f}/s) Serve's policy needs {needed:.0f} replica-seconds: "
              f"queue_kv uses {saving:.1%} fewer")
    print(f"at equal replica-seconds ({ours.replica_seconds:.0f}) Serve's policy reaches "
          f"{goodput_at(ours.replica_seconds, curve):.3f} good/s: queue_kv gets {gain:.1%} more")
    met = (saving is not None and saving >= 0.2) or gain >= 0.2
    print(f"target (>= 20% fewer replica-seconds at equal goodput, or >= 20% more goodput at equal "
          f"replica-seconds): {'met' if met else 'not met'}")
    tight_needed = replica_seconds_for(tight.goodput_rps, curve)
    tight_saving = None if tight_needed is None else 1 - tight.replica_seconds / tight_needed
    if tight_saving is not None:
        print(f"{tight.policy}: {tight.goodput_rps / serve_default.goodput_rps:.1%} of the default policy's goodput; "
              f"at equal goodput {tight_saving:.1%} fewer replica-seconds than Serve's policy")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "trace": str(args.trace), "block_size": args.block_size, "time_scale": args.time_scale,
        "requests": len(requests), "profile": profile.name, "serve": dataclasses.asdict(serve),
        "startup_s": args.startup_s, "slo": dataclasses.asdict(slo), "seeds": args.seeds,
        "queue_kv": dataclasses.asdict(QueueKVConfig()), "results": [s.as_dict() for s in summaries],
        "comparison": {"replica_seconds_saving_at_equal_goodput": saving, "goodput_gain_at_equal_replica_seconds": gain,
                       "serve_default_replica_seconds_saving": 1 - ours.replica_seconds / serve_default.replica_seconds,
                       "serve_default_goodput_ratio": ours.goodput_rps / serve_default.goodput_rps,
                       "target_met": met, "tight_replica_seconds_saving_at_equal_goodput": tight_saving}},
        indent=2) + "\n")
    nearest = min(curve, key=lambda s: abs(s.goodput_rps - ours.goodput_rps))
    picked = [shown["queue_kv"], shown[serve_default.policy]] + (
        [shown[nearest.policy]] if nearest is not serve_default else [])
    plot(picked, slo, out.with_suffix(".png"), title=f"Mooncake trace ({len(requests)} requests), seed 0")
    _plot_curve([ours, tight], curve, out.with_name(out.stem + "_curve.png"))
    print(f"wrote {out}, {out.with_suffix('.png')} and {out.with_name(out.stem + '_curve.png')}")


def _plot_curve(ours: list[Summary], curve: list[Summary], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = sorted(curve, key=lambda s: s.replica_seconds)
    ax.plot([p.replica_seconds for p in points], [p.goodput_rps for p in points], "o-",
            label="Serve's default policy (target_ongoing_requests)")
    for p in points:
        ax.annotate(p.policy.split(":")[1], (p.replica_seconds, p.goodput_rps), fontsize=7,
                    textcoords="offset points", xytext=(3, 3))
    for summary, marker in zip(ours, ("r*", "m^")):
        ax.plot([summary.replica_seconds], [summary.goodput_rps], marker, markersize=12, label=summary.policy)
    ax.set_xlabel("replica-seconds (cost)")
    ax.set_ylabel("goodput (good requests/s)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
