"""Autoscaling policies, simulated on workloads none of them was fitted to: replica-seconds at equal goodput.

Workloads: each half of the Mooncake trace (8 tokens per hash id, on its own clock), and three synthetic ones
(autoscaling.workload.ShapedWorkload, seed 0): steps, bursts and a daily cycle, their base rate 1.5 replicas' worth
of work on the profile's replicas (autoscaling.workload.scaled_to), so that they span one replica to several. The
SLO policy's fitted default (its forecaster's time constants) came from other seeds of the synthetic shapes
(benchmarks/fit_forecast.py); the queue + KV policy's waiting marks from the trace's first half. Each run starts
`WARMUP_S` before the window it is judged on (the second half's run starts in the first half; the first half's run
and the synthetic ones start with the workload and are judged from `WARMUP_S` on), so every policy meets the window
with its own count.

Policies, on replicas of the recorded profile whose engines order their queues for the SLO's TTFT
(engine.ttft_objective_s, as the app sets it under the SLO policy; `--arrival-order`: not), with AppArgs' Serve
delays and at most `--max-replicas` each:
the SLO policy (autoscaling.slo_policy, its defaults, the SLO below), the queue + KV policy (its defaults), and
Serve's default policy at several `target_ongoing_requests`, which traces the goodput it buys per replica-second:
"Serve's default at its best target" is read off that curve. Each runs with `--seeds` routing seeds; the tables
show their means. Per workload:

- at equal goodput: the replica-seconds Serve's curve needs for the goodput a policy reached (the cheapest target
  that reaches it, interpolated from the next cheaper one), against the policy's own;
- at equal replica-seconds: the goodput Serve's curve reaches with as many, against the policy's;
- SLO attainment: the share of the window's requests that met both objectives.

`--foresight` also runs `autoscaling.foresight.ForesightPolicy`, the SLO policy's planning with a perfect forecast,
at headrooms 0 to 0.3: a bound on what any forecast could save here. `--training` runs the synthetic shapes at the
training seeds instead (benchmarks/fit_forecast.py's), where
changes to the SLO policy are measured before the benchmark sees them. `--levers` also runs the SLO policy without
each of its parts, and every policy with a 30 s downscale delay, to show what each part gives; `--variants` runs
other policies beside them (a knob of the SLO policy at other values, as `slo:knob=value`). Writes JSON, the
curves (PNG) and the replica counts over time (PNG).

    python -m benchmarks.bench_autoscale    # the Mooncake trace kept in loadtests/traces/, or --trace FILE
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autoscaling.capacity import SLO
from autoscaling.foresight import ForesightPolicy
from autoscaling.report import Summary, summarize, table
from autoscaling.serve_rules import ServeAutoscalingConfig
from autoscaling.simulate import parse_policy
from autoscaling.simulator import ClusterConfig, SimResult, simulate
from autoscaling.step_model import DEFAULT_PROFILE, ReplicaProfile, StepTimeModel
from autoscaling.workload import RequestSpec, ShapedWorkload, TraceWorkload, saturation_rate, scaled_to
from benchmarks.fit_forecast import TRAINING_SEEDS
from deployments.autoscaling_config import AutoscalingArgs
from loadtests.datasets import MOONCAKE_TRACE
from loadtests.plot import pyplot, save_figure

log = logging.getLogger("bench_autoscale")

TARGETS = (2, 4, 6, 8, 12, 16, 24, 32)
WARMUP_S = 120.0
SHAPES = ("steps", "bursts", "daily")
OURS = ("slo", "queue_kv")
# Each part of the SLO policy taken away in turn (--levers).
LEVERS = {"slo:headroom=0": "nothing held beyond the forecast (no observed surprise, no prior)",
          "slo:level_time_s=1": "no smoothing (the load as last measured)",
          "slo:trend_time_s=240": "a trend in the forecast (the best of fit-forecast's)"}
# Perfect foresight of the load at a few headrooms (--foresight; autoscaling/foresight.py): a bound, not a policy.
FORESIGHT = tuple(f"foresight:{h:g}" for h in (0.0, 0.1, 0.2, 0.3))
SHORT_DOWNSCALE_S = 30.0
LOAD_BIN_S = 30.0  # the offered load is shown in windows of this many seconds
TARGET_SAVING = 0.25
TARGET_ATTAINMENT = 0.95


@dataclass(frozen=True)
class Case:
    """A workload, and the window of its run that is judged."""

    name: str
    requests: list[RequestSpec]
    start_s: float
    end_s: float


def synthetic_case(name: str, shape: str, seed: int, profile: ReplicaProfile) -> Case:
    workload = scaled_to(profile.step_model, ShapedWorkload(shape, seed=seed))
    return Case(name, workload.requests(), WARMUP_S, workload.duration_s)


def training_cases(profile: ReplicaProfile) -> list[Case]:
    """The synthetic shapes at the training seeds (benchmarks/fit_forecast.py), where changes to the SLO policy are
    measured before the benchmark's workloads see them."""
    return [synthetic_case(f"training {shape} seed {seed}", shape, seed, profile)
            for shape in SHAPES for seed in TRAINING_SEEDS]


def cases(trace: Path, block_size: int, profile: ReplicaProfile) -> list[Case]:
    rows = TraceWorkload(str(trace), block_size).requests()
    middle = rows[-1].arrival_s / 2
    shift = middle - WARMUP_S
    second = [dataclasses.replace(r, arrival_s=r.arrival_s - shift) for r in rows if r.arrival_s >= shift]
    out = [Case("mooncake first half", [r for r in rows if r.arrival_s < middle], WARMUP_S, middle),
           Case("mooncake second half", second, WARMUP_S, rows[-1].arrival_s - shift)]
    return out + [synthetic_case(f"synthetic {shape}", shape, 0, profile) for shape in SHAPES]


def offered_load(case: Case, model: StepTimeModel, bin_s: float = LOAD_BIN_S) -> dict[str, float]:
    """The work a case's judged window offers, in replicas' worth (the seconds one replica of `model` is busy with
    each request: autoscaling.workload.saturation_rate), over the whole window and in each `bin_s` of it (its lowest
    and highest). A load whose windows stay within one replica leaves a policy nothing to scale."""
    work = np.zeros(max(1, math.ceil((case.end_s - case.start_s) / bin_s)))
    for r in case.requests:
        if case.start_s <= r.arrival_s < case.end_s:
            work[min(int((r.arrival_s - case.start_s) // bin_s), len(work) - 1)] += 1.0 / saturation_rate(model, [r])
    whole = work[: max(1, int((case.end_s - case.start_s) // bin_s))]  # full windows only for the range
    return {"mean": float(work.sum() / max(case.end_s - case.start_s, 1e-9)), "min": float(whole.min() / bin_s),
            "max": float(whole.max() / bin_s)}


@dataclass(frozen=True)
class Job:
    case: int
    policy: str
    seed: int
    downscale_delay_s: float


def run_job(job: Job, case: Case, profile: ReplicaProfile, cluster: ClusterConfig,
            slo: SLO) -> tuple[Job, Summary, SimResult | None]:
    serve = dataclasses.replace(cluster.serve, downscale_delay_s=job.downscale_delay_s)
    cluster = dataclasses.replace(cluster, serve=serve, seed=job.seed)
    if job.policy.startswith("foresight:"):
        policy = ForesightPolicy(case.requests, profile, slo, cluster.startup_s,
                                 headroom=float(job.policy.partition(":")[2]), name=job.policy)
    else:
        policy = parse_policy(job.policy, slo)
    result = simulate(case.requests, profile, policy, cluster)
    summary = summarize(result, slo, case.start_s, case.end_s)
    return job, summary, result if job.seed == 0 else None


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


def compare(ours: Summary, curve: list[Summary]) -> dict:
    """Where a policy stands against Serve's curve."""
    needed = replica_seconds_for(ours.goodput_rps, curve)
    met = [s for s in curve if s.attainment >= TARGET_ATTAINMENT]
    best = min(met, key=lambda s: s.replica_seconds) if met else max(curve, key=lambda s: s.goodput_rps)
    saving = None if needed is None else 1 - ours.replica_seconds / needed
    return {"policy": ours.policy, "attainment": ours.attainment, "goodput_rps": ours.goodput_rps,
            "replica_seconds": ours.replica_seconds,
            "serve_replica_seconds_at_equal_goodput": needed, "replica_seconds_saving": saving,
            "serve_goodput_at_equal_replica_seconds": goodput_at(ours.replica_seconds, curve),
            "goodput_gain": ours.goodput_rps / goodput_at(ours.replica_seconds, curve) - 1,
            "serve_best_target": best.policy, "serve_best_attainment": best.attainment,
            "serve_best_replica_seconds": best.replica_seconds,
            "target_met": saving is not None and saving >= TARGET_SAVING and ours.attainment >= TARGET_ATTAINMENT}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=MOONCAKE_TRACE)
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE))
    parser.add_argument("--block-size", type=int, default=8, help="prompt tokens per trace hash id")
    parser.add_argument("--max-replicas", type=int, default=12)
    parser.add_argument("--startup-s", type=float, default=15.0, help="replica asked for -> serving")
    parser.add_argument("--slo-ttft-s", type=float, default=SLO.ttft_s)
    parser.add_argument("--slo-itl-s", type=float, default=SLO.itl_s)
    parser.add_argument("--slo-percentile", type=float, default=SLO.percentile)
    parser.add_argument("--downscale-delay-s", type=float, default=None,
                        help="Serve's downscale delay for every policy (default: AppArgs')")
    parser.add_argument("--arrival-order", action="store_true",
                        help="engines admit in arrival order alone (default: engine.ttft_objective_s at the SLO's "
                             "TTFT, as the app sets it under the SLO policy, for every policy alike)")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=2, help="simulations run at once")
    parser.add_argument("--levers", action="store_true", help="also run the SLO policy without each of its parts, "
                                                              "and every policy with a 30 s downscale delay")
    parser.add_argument("--foresight", action="store_true",
                        help="also run the SLO policy's planning with perfect foresight of the load, at headrooms "
                             "0 to 0.3: what a perfect forecast would save against Serve's curve")
    parser.add_argument("--variants", nargs="*", default=[], metavar="POLICY",
                        help="also run these policies, compared like the SLO policy "
                             "(e.g. slo:scale_in_trend_time_s=30; autoscaling.simulate's syntax)")
    parser.add_argument("--training", action="store_true",
                        help="run the training workloads (the synthetic shapes at the training seeds) instead")
    parser.add_argument("--out", default="results/bench_autoscale.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    profile = ReplicaProfile.load(args.profile)
    defaults = AutoscalingArgs()
    downscale_s = defaults.downscale_delay_s if args.downscale_delay_s is None else args.downscale_delay_s
    serve = ServeAutoscalingConfig(min_replicas=1, max_replicas=args.max_replicas,
                                   upscale_delay_s=defaults.upscale_delay_s,
                                   downscale_delay_s=downscale_s,
                                   look_back_period_s=defaults.look_back_period_s,
                                   metrics_interval_s=defaults.metrics_interval_s)
    slo = SLO(args.slo_ttft_s, args.slo_itl_s, args.slo_percentile)
    workloads = training_cases(profile) if args.training else cases(args.trace, args.block_size, profile)
    curve_names = [f"ongoing_requests:{t}" for t in TARGETS]
    delays = [downscale_s] + ([SHORT_DOWNSCALE_S] if args.levers else [])
    jobs = [Job(c, p, seed, d) for c in range(len(workloads)) for d in delays
            for p in list(OURS) + args.variants + curve_names + (list(LEVERS) if args.levers and d == delays[0] else [])
            + (list(FORESIGHT) if args.foresight and d == delays[0] else [])
            for seed in range(args.seeds)]
    runs: dict[tuple[int, str, float], list[Summary]] = {}
    shown: dict[tuple[int, str, float], SimResult] = {}
    with ProcessPoolExecutor(args.jobs) as pool:
        cluster = ClusterConfig(serve=serve, startup_s=args.startup_s,
                                ttft_objective_s=None if args.arrival_order else slo.ttft_s)
        futures = [pool.submit(run_job, job, workloads[job.case], profile, cluster, slo) for job in jobs]
        for future in futures:
            job, summary, result = future.result()
            key = (job.case, job.policy, job.downscale_delay_s)
            runs.setdefault(key, []).append(summary)
            if result is not None:
                shown[key] = result
            log.info("%s, %s, seed %d, downscale %gs: attainment %.3f, %.0f replica-s", workloads[job.case].name,
                     job.policy, job.seed, job.downscale_delay_s, summary.attainment, summary.replica_seconds)

    report = []
    for c, case in enumerate(workloads):
        for delay in delays:
            means = {p: mean_summary(runs[(c, p, delay)]) for p in {k[1] for k in runs if k[0] == c and k[2] == delay}}
            curve = [means[p] for p in curve_names]
            ours = [p for p in list(OURS) + args.variants + list(LEVERS) + list(FORESIGHT) if p in means]
            comparisons = {p: compare(means[p], curve) for p in ours}
            load = offered_load(case, profile.step_model)
            report.append({"workload": case.name, "downscale_delay_s": delay, "requests": len(case.requests),
                           "window_s": [case.start_s, case.end_s], "offered_replicas": load,
                           "results": [means[p].as_dict() for p in ours + curve_names],
                           "comparisons": comparisons})
            _print_case(case, delay, [means[p] for p in ours + curve_names], comparisons, load)
    _print_totals([r for r in report if r["downscale_delay_s"] == delays[0]])
    met = all(r["comparisons"]["slo"]["target_met"] for r in report if r["downscale_delay_s"] == delays[0])
    print(f"\ntarget (each workload: >= {TARGET_SAVING:.0%} fewer replica-seconds than Serve's default at equal "
          f"goodput, >= {TARGET_ATTAINMENT:.0%} attainment): {'met' if met else 'not met'}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "trace": str(args.trace), "block_size": args.block_size, "profile": profile.name,
        "serve": dataclasses.asdict(serve), "startup_s": args.startup_s, "slo": dataclasses.asdict(slo),
        "seeds": args.seeds, "warmup_s": WARMUP_S, "levers": LEVERS if args.levers else {},
        "foresight": list(FORESIGHT) if args.foresight else [], "cases": report,
        "target_met": met}, indent=2) + "\n")
    _plot_curves(report, delays[0], out.with_suffix(".png"))
    timelines = out.with_name(out.stem + "_timelines.png")
    _plot_timelines(workloads, shown, report, delays[0], slo, timelines)
    print(f"wrote {out}, {out.with_suffix('.png')} and {timelines}")


def _print_case(case: Case, delay: float, summaries: list[Summary], comparisons: dict,
                load: dict[str, float]) -> None:
    print(f"\n{case.name}: {len(case.requests)} requests, judged over [{case.start_s:.0f}, {case.end_s:.0f}] s, "
          f"downscale delay {delay:g} s; offered load {load['mean']:.2f} replicas' worth of work "
          f"({load['min']:.2f}-{load['max']:.2f} over {LOAD_BIN_S:g} s windows)")
    print(table(summaries))
    for name, c in comparisons.items():
        saving = "n/a (Serve's curve never reaches it)" if c["replica_seconds_saving"] is None else \
            f"{c['replica_seconds_saving']:.1%} fewer replica-seconds"
        print(f"  {name}: attainment {c['attainment']:.1%}; at equal goodput {saving}; at equal replica-seconds "
              f"{c['goodput_gain']:+.1%} goodput; Serve's cheapest target at >= {TARGET_ATTAINMENT:.0%}: "
              f"{c['serve_best_target']} ({c['serve_best_attainment']:.1%}, {c['serve_best_replica_seconds']:.0f} "
              f"replica-s)")


def _print_totals(report: list[dict]) -> None:
    """Per policy over every workload: replica-seconds summed, the lowest attainment, the workloads where the target
    is met, and the mean saving over those where Serve's curve reaches the policy's goodput."""
    print("\nover all workloads:")
    for name in report[0]["comparisons"]:
        rows = [r["comparisons"][name] for r in report]
        savings = [c["replica_seconds_saving"] for c in rows if c["replica_seconds_saving"] is not None]
        mean = f"{np.mean(savings):.1%} over {len(savings)}" if savings else "n/a"
        print(f"  {name}: {sum(c['replica_seconds'] for c in rows):,.0f} replica-s, lowest attainment "
              f"{min(c['attainment'] for c in rows):.1%}, target met on {sum(c['target_met'] for c in rows)} of "
              f"{len(rows)}, mean saving {mean}")


def _plot_curves(report: list[dict], delay: float, path: Path) -> None:
    """Goodput against replica-seconds, one panel per workload: Serve's curve and each policy's point."""
    plt = pyplot()
    cases_shown = [r for r in report if r["downscale_delay_s"] == delay]
    fig, axes = plt.subplots(1, len(cases_shown), figsize=(4.2 * len(cases_shown), 4))
    for ax, case in zip(np.atleast_1d(axes), cases_shown):
        rows = {r["policy"]: r for r in case["results"]}
        curve = sorted((r for p, r in rows.items() if p.startswith("ongoing_requests")),
                       key=lambda r: r["replica_seconds"])
        ax.plot([r["replica_seconds"] for r in curve], [r["goodput_rps"] for r in curve], "o-", color="tab:blue",
                label="Serve's default (target)")
        for r in curve:
            ax.annotate(r["policy"].split(":")[1], (r["replica_seconds"], r["goodput_rps"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
        for name, marker in (("slo", "r*"), ("queue_kv", "g^")):
            ax.plot([rows[name]["replica_seconds"]], [rows[name]["goodput_rps"]], marker, markersize=12,
                    label=f"{name} ({rows[name]['attainment']:.1%})")
        ax.set_title(case["workload"], fontsize=9)
        ax.set_xlabel("replica-seconds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    np.atleast_1d(axes)[0].set_ylabel("goodput (good requests/s)")
    fig.tight_layout()
    save_figure(fig, path)


def _plot_timelines(workloads: list[Case], shown: dict, report: list[dict], delay: float, slo: SLO,
                    path: Path) -> None:
    """Replicas over time (seed 0) per workload: the SLO policy, queue + KV, and Serve at its best target."""
    plt = pyplot()
    fig, axes = plt.subplots(len(workloads), 1, figsize=(11, 2.4 * len(workloads)))
    for c, (ax, case) in enumerate(zip(np.atleast_1d(axes), workloads)):
        best = next(r for r in report if r["workload"] == case.name and r["downscale_delay_s"] == delay)
        best_target = best["comparisons"]["slo"]["serve_best_target"]
        for name, color in (("slo", "tab:red"), ("queue_kv", "tab:green"), (best_target, "tab:blue")):
            result = shown[(c, name, delay)]
            ax.step([p.t for p in result.timeline], [p.running + p.starting + p.draining for p in result.timeline],
                    where="post", color=color, lw=1, label=name)
        ax.axvspan(case.start_s, case.end_s, color="grey", alpha=0.08)
        ax.set_ylabel("replicas")
        ax.set_title(case.name, fontsize=9, loc="left")
        ax.legend(fontsize=7, loc="upper right")
    np.atleast_1d(axes)[-1].set_xlabel("time (s); shaded: the window judged")
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
