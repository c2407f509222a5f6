"""Command line: replay a workload against autoscaling policies, side by side, and write JSON and a plot.

    python -m autoscaling.simulate --trace loadtests/traces/mooncake_synthetic_trace.jsonl --time-scale 0.5 \
        --policies queue_kv ongoing_requests:2 ongoing_requests:16 --max-replicas 6 --out results/simulate.json

A policy is `slo` (knobs as `slo:headroom=0.1,percentile=0.9`), `queue_kv` (thresholds as
`queue_kv:waiting_high=4,kv_high=0.9`) or `ongoing_requests:TARGET` (Serve's default policy with that
target_ongoing_requests). Every policy sees the same requests, replicas and
seed. Without --trace the workload is synthetic (--num-requests, --rate, --input-mean, ...).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

from autoscaling.policy import QueueKVConfig
from autoscaling.capacity import SLO
from autoscaling.report import plot, summarize, table
from autoscaling.serve_rules import ServeAutoscalingConfig
from autoscaling.simulator import (ClusterConfig, OngoingRequestsPolicy, Policy, QueueKVSimPolicy, SLOSimPolicy,
                                  simulate)
from autoscaling.slo_policy import SLOConfig
from autoscaling.step_model import DEFAULT_PROFILE, ReplicaProfile
from autoscaling.workload import RequestSpec, SyntheticWorkload, TraceWorkload

log = logging.getLogger("autoscaling.simulate")


def parse_policy(text: str, slo: SLO | None = None) -> Policy:
    """`slo[:k=v,...]`, `queue_kv[:k=v,...]` or `ongoing_requests:TARGET`; the name shown is the text itself.
    An `slo` policy holds `slo` unless its own knobs say otherwise."""
    kind, _, params = text.partition(":")
    if kind in ("slo", "queue_kv"):
        config_type = SLOConfig if kind == "slo" else QueueKVConfig
        types = {f.name: f.type for f in dataclasses.fields(config_type)}
        values: dict = {}
        for item in filter(None, params.split(",")):
            key, _, value = item.partition("=")
            if key not in types:
                raise ValueError(f"{kind} has no knob {key!r}; it has {sorted(types)}")
            values[key] = (None if value == "none" else value if types[key] == "str"
                           else int(value) if types[key] == "int" else float(value))
        if kind == "slo":
            objectives = dataclasses.asdict(slo) if slo else {}
            return SLOSimPolicy(SLOConfig(**{**objectives, **values}), name=text)
        return QueueKVSimPolicy(QueueKVConfig(**values), name=text)
    if kind == "ongoing_requests":
        return OngoingRequestsPolicy(float(params or 2.0), name=text)
    raise ValueError(f"unknown policy {text!r}: use slo[:k=v,...], queue_kv[:k=v,...] or ongoing_requests:TARGET")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE), help="replica profile JSON (step_profile.py)")
    parser.add_argument("--num-kv-blocks", type=int, help="override the profile's KV pool (blocks per replica)")
    parser.add_argument("--policies", nargs="+", default=["slo", "queue_kv", "ongoing_requests:2"])
    workload = parser.add_argument_group("workload")
    workload.add_argument("--trace", help="a Mooncake trace (JSONL); without it the workload is synthetic")
    workload.add_argument("--block-size", type=int, default=8, help="prompt tokens per trace hash id")
    workload.add_argument("--time-scale", type=float, default=1.0, help="multiplies the trace's arrival gaps")
    workload.add_argument("--trace-start-ms", type=float)
    workload.add_argument("--trace-end-ms", type=float)
    workload.add_argument("--max-output-tokens", type=int)
    workload.add_argument("--num-requests", type=int, default=200)
    workload.add_argument("--rate", type=float, default=2.0, help="synthetic requests/s (0: all at once)")
    workload.add_argument("--arrival", default="poisson", choices=["constant", "poisson", "gamma"])
    workload.add_argument("--burstiness", type=float, default=1.0)
    workload.add_argument("--input-mean", type=int, default=256)
    workload.add_argument("--input-std", type=float, default=64)
    workload.add_argument("--output-mean", type=int, default=128)
    workload.add_argument("--output-std", type=float, default=32)
    serve = parser.add_argument_group("Serve")
    serve.add_argument("--min-replicas", type=int, default=1)
    serve.add_argument("--max-replicas", type=int, default=4)
    serve.add_argument("--initial-replicas", type=int, default=None, help="default: min replicas, at least 1")
    serve.add_argument("--upscale-delay-s", type=float, default=10.0)
    serve.add_argument("--downscale-delay-s", type=float, default=60.0)
    serve.add_argument("--downscale-to-zero-delay-s", type=float, default=None)
    serve.add_argument("--look-back-period-s", type=float, default=10.0)
    serve.add_argument("--metrics-interval-s", type=float, default=1.0)
    serve.add_argument("--startup-s", type=float, default=15.0, help="replica asked for -> serving")
    serve.add_argument("--graceful-shutdown-timeout-s", type=float, default=60.0)
    serve.add_argument("--control-interval-s", type=float, default=0.5)
    serve.add_argument("--busy-slowdown", type=float, default=1.0,
                       help="a step's time multiplier while another replica steps too (replicas sharing cores)")
    parser.add_argument("--no-prefix-cache", action="store_true")
    parser.add_argument("--ttft-objective-s", type=float, default=None,
                        help="the engines' engine.ttft_objective_s (requests past half of it go behind those on "
                             "time); default: none, arrival order")
    parser.add_argument("--slo-ttft-s", type=float, default=SLO.ttft_s)
    parser.add_argument("--slo-itl-s", type=float, default=SLO.itl_s)
    parser.add_argument("--slo-percentile", type=float, default=SLO.percentile,
                        help="the share of requests an slo policy holds the objectives for")
    parser.add_argument("--seed", type=int, default=0)


def workload_from(args: argparse.Namespace) -> tuple[list[RequestSpec], dict]:
    if args.trace:
        workload = TraceWorkload(args.trace, args.block_size, args.time_scale, args.trace_start_ms,
                                 args.trace_end_ms, max_output_tokens=args.max_output_tokens)
    else:
        workload = SyntheticWorkload(args.num_requests, args.rate or None, args.arrival, args.burstiness,
                                     args.input_mean, args.input_std, args.output_mean, args.output_std, args.seed)
    return workload.requests(), {"kind": type(workload).__name__, **dataclasses.asdict(workload)}


def profile_from(args: argparse.Namespace) -> ReplicaProfile:
    profile = ReplicaProfile.load(args.profile)
    if args.num_kv_blocks:
        engine = dataclasses.replace(profile.engine, num_kv_blocks=args.num_kv_blocks)
        profile = dataclasses.replace(profile, engine=engine)
    return profile


def cluster_from(args: argparse.Namespace) -> ClusterConfig:
    serve = ServeAutoscalingConfig(min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                                   upscale_delay_s=args.upscale_delay_s, downscale_delay_s=args.downscale_delay_s,
                                   downscale_to_zero_delay_s=args.downscale_to_zero_delay_s,
                                   look_back_period_s=args.look_back_period_s,
                                   metrics_interval_s=args.metrics_interval_s)
    initial = args.initial_replicas if args.initial_replicas is not None else max(args.min_replicas, 1)
    return ClusterConfig(serve=serve, initial_replicas=initial,
                         startup_s=args.startup_s, graceful_shutdown_timeout_s=args.graceful_shutdown_timeout_s,
                         control_interval_s=args.control_interval_s, prefix_cache=not args.no_prefix_cache,
                         busy_slowdown=args.busy_slowdown, ttft_objective_s=args.ttft_objective_s, seed=args.seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--out", default="results/simulate.json")
    parser.add_argument("--plot", default=None, help="PNG path (default: beside --out)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    requests, workload = workload_from(args)
    profile, cluster = profile_from(args), cluster_from(args)
    slo = SLO(args.slo_ttft_s, args.slo_itl_s, args.slo_percentile)
    results = []
    for text in args.policies:
        results.append(simulate(requests, profile, parse_policy(text, slo), cluster))
        log.info("simulated %s", text)
    summaries = [summarize(r, slo) for r in results]
    print(table(summaries))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "profile": args.profile, "engine": dataclasses.asdict(profile.engine), "workload": workload,
        "cluster": dataclasses.asdict(cluster), "slo": dataclasses.asdict(slo),
        "results": [s.as_dict() for s in summaries]}, indent=2) + "\n")
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    plot(results, slo, png, title=f"{len(requests)} requests, {profile.name}")
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    main()
