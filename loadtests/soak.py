"""Soak: the app under 1.5x its measured capacity for a long while (20 minutes by default), then a report.

It starts its own app (2 engine replicas on a local Ray, loopback only), measures capacity with a closed loop,
then sends Poisson arrivals at `--load-factor` times that rate. Past the app's bounds requests are refused
(503 with Retry-After), so what the run shows is whether refusals stay clean, latency of what is admitted stays
put, and no process grows. It reports errors by kind, latency percentiles per minute and each process's RSS
(ingress, each engine replica, proxy, controller) over time, writes JSON and stops by itself.

    make soak                                   # 20 minutes
    make soak SOAK_ARGS="--duration 180"        # a short check
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from loadtests.client import StreamingClient
from loadtests.metrics import percentile
from loadtests.openai_api import EndpointConfig
from loadtests.records import RequestRecord, RequestSpec

log = logging.getLogger("soak")

WORDS = ("river stone lantern orbit harbor meadow copper signal canyon ember glacier violet thunder willow "
         "compass marble falcon prairie quartz saffron tundra velvet zephyr beacon cobalt dune fjord grove").split()
# Refusals named by what refused them (the message of the OpenAI-shaped error, or Serve's own text).
ERROR_KINDS = (("requests at once", "ingress_concurrency_limit"), ("s behind: this request", "engine_deadline_admission"),
               ("waiting queue is full", "engine_waiting_queue"),
               ("every engine replica is busy", "engine_handle_queue"), ("backpressure", "proxy_queue"),
               ("deadline", "request_timeout"), ("engine replica", "engine_replica_lost"))


@dataclass(frozen=True)
class DeadlineEndpoint(EndpointConfig):
    """Every request carries a server-side deadline (X-Request-Timeout), shorter than the client's own timeout:
    work nobody waits for is aborted by the server and shows as a 408, not as a client timeout."""

    deadline_s: float = 60.0

    def headers(self, request_id: str) -> dict[str, str]:
        return {**super().headers(request_id), "X-Request-Timeout": f"{self.deadline_s:g}"}


@dataclass
class MinuteStats:
    minute: int
    sent: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    e2e_s: dict[str, float] = field(default_factory=dict)
    ttft_s: dict[str, float] = field(default_factory=dict)
    output_tokens_per_s: float = 0.0


def error_kind(record: RequestRecord) -> str:
    if record.error is None:
        return "ok"
    message = record.error.message
    for needle, kind in ERROR_KINDS:
        if needle in message:
            return f"{record.error.code}_{kind}"
    return f"{record.error.code}_{record.error.type}"


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {"p50": round(percentile(values, 0.50), 4), "p90": round(percentile(values, 0.90), 4),
            "p99": round(percentile(values, 0.99), 4), "max": round(max(values), 4)}


def make_specs(count: int, seed: int, max_tokens: int) -> list[RequestSpec]:
    rng = random.Random(seed)
    specs = []
    for i in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randrange(40, 200))]
        specs.append(RequestSpec(i, f"Write about: {' '.join(words)}", len(words), max_tokens))
    return specs


def app_processes() -> dict[str, int]:
    """PIDs of the app's processes: ingress and engine replicas, the HTTP proxy, the Serve controller."""
    import ray

    from deployments.local import APP_NAME

    pids = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if name.startswith(f"SERVE_REPLICA::{APP_NAME}#"):
            label = name.split("#", 1)[1].replace("#", ":")
        elif name.startswith("SERVE_PROXY_ACTOR"):
            label = "proxy"
        elif name == "SERVE_CONTROLLER_ACTOR":
            label = "controller"
        else:
            continue
        try:
            actor = ray.get_actor(name, namespace=entry.get("namespace") or "serve")
            pids[label] = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
        except Exception as exc:  # starting or gone
            log.warning("no pid for %s: %r", name, exc)
    return pids


def rss_mb(pids: dict[str, int]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for label, pid in pids.items():
        try:
            out[label] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
        except psutil.NoSuchProcess:
            out[label] = None
    return out


async def measure_capacity(client: StreamingClient, specs: list[RequestSpec], concurrency: int,
                           seconds: float) -> float:
    """Completed requests per second of a closed loop at `concurrency`, after its first fifth (warm-up)."""
    start = time.monotonic()
    warm_at = start + seconds / 5
    done_after_warm: list[RequestRecord] = []
    queue = iter(specs)

    async def worker() -> None:
        while time.monotonic() - start < seconds:
            record = await client.send(next(queue), phase="capacity")
            if time.monotonic() >= warm_at and record.ok:
                done_after_warm.append(record)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(done_after_warm) / (time.monotonic() - warm_at)


async def soak(client: StreamingClient, specs: list[RequestSpec], rate: float, seconds: float, seed: int,
               max_in_flight: int, on_minute) -> tuple[list[tuple[float, RequestRecord]], int]:
    """Poisson arrivals at `rate` for `seconds`; returns (send offset, record) pairs and requests not sent
    because the client already had `max_in_flight` open (a bound on the client, not the server)."""
    rng = random.Random(seed)
    start = time.monotonic()
    tasks: list[tuple[float, asyncio.Task]] = []
    skipped = 0
    next_at, next_minute, index = 0.0, 60.0, 0
    in_flight = 0

    async def send(spec: RequestSpec) -> RequestRecord:
        nonlocal in_flight
        in_flight += 1
        try:
            return await client.send(spec)
        finally:
            in_flight -= 1

    while next_at < seconds:
        now = time.monotonic() - start
        if now >= next_minute:
            on_minute(int(next_minute // 60))
            next_minute += 60
        if next_at > now:
            await asyncio.sleep(min(next_at - now, next_minute - now))
            continue
        if in_flight >= max_in_flight:
            skipped += 1
        else:
            tasks.append((next_at, asyncio.create_task(send(specs[index % len(specs)]))))
            index += 1
        next_at += rng.expovariate(rate)
    results = [(offset, await task) for offset, task in tasks]
    on_minute(int(seconds // 60) + 1)
    return results, skipped


def summarize(results: list[tuple[float, RequestRecord]]) -> list[MinuteStats]:
    by_minute: dict[int, list[RequestRecord]] = defaultdict(list)
    for offset, record in results:
        by_minute[int(offset // 60)].append(record)
    minutes = []
    for minute in sorted(by_minute):
        records = by_minute[minute]
        ok = [r for r in records if r.ok]
        errors = Counter(error_kind(r) for r in records if not r.ok)
        e2e = [(r.end_perf_ns - r.start_perf_ns) / 1e9 for r in ok if r.end_perf_ns]
        ttft = [(r.chunk_perf_ns[0] - r.start_perf_ns) / 1e9 for r in ok if r.chunk_perf_ns]
        tokens = sum((r.usage.completion_tokens or 0) for r in ok if r.usage)
        minutes.append(MinuteStats(minute, len(records), len(ok), dict(errors), percentiles(e2e), percentiles(ttft),
                                   round(tokens / 60, 1)))
    return minutes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", default="results/soak.json")
    parser.add_argument("--duration", type=float, default=1200.0, help="seconds of soak (default 20 minutes)")
    parser.add_argument("--load-factor", type=float, default=1.5, help="times the measured capacity")
    parser.add_argument("--capacity-seconds", type=float, default=60.0)
    parser.add_argument("--capacity-concurrency", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-in-flight", type=int, default=2048, help="the client's own bound on open requests")
    parser.add_argument("--deadline", type=float, default=60.0, help="each request's X-Request-Timeout, seconds")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="the client's own timeout, seconds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from deployments import local
    from deployments.config import AppArgs

    app_args = AppArgs(model=args.model, num_engine_replicas=2, engine_num_cpus=1, ingress_max_replicas=1)
    app = local.start(app_args, num_cpus=2)
    try:
        report = asyncio.run(run(args, app))
    finally:
        app.stop()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print_report(report)
    print(f"wrote {args.out}")


async def run(args: argparse.Namespace, app) -> dict:
    endpoint = DeadlineEndpoint(base_url=app.base_url, model=app.model, endpoint="chat", streaming=True,
                                ignore_eos=True, deadline_s=args.deadline)
    specs = make_specs(4096, args.seed, args.max_tokens)
    pids = app_processes()
    rss_samples: list[dict] = [{"t_s": 0.0, **rss_mb(pids)}]
    async with StreamingClient(endpoint, request_timeout_s=args.request_timeout,
                               max_connections=args.max_in_flight) as client:
        log.info("measuring capacity: closed loop of %d for %.0f s", args.capacity_concurrency, args.capacity_seconds)
        capacity = await measure_capacity(client, specs, args.capacity_concurrency, args.capacity_seconds)
        rate = capacity * args.load_factor
        log.info("capacity %.2f req/s; soaking at %.2f req/s for %.0f s", capacity, rate, args.duration)
        rss_start = rss_mb(pids)
        started = time.monotonic()

        def on_minute(minute: int) -> None:
            sample = {"t_s": round(time.monotonic() - started, 1), **rss_mb(pids)}
            rss_samples.append(sample)
            log.info("minute %d: rss %s", minute, {k: v for k, v in sample.items() if k != "t_s"})

        results, skipped = await soak(client, specs, rate, args.duration, args.seed + 1, args.max_in_flight,
                                      on_minute)
    await asyncio.sleep(10)  # an idle engine returns freed heap within a few seconds
    rss_end = rss_mb(pids)
    records = [r for _, r in results]
    errors = Counter(error_kind(r) for r in records if not r.ok)
    return {
        "model": app.model, "duration_s": args.duration, "load_factor": args.load_factor,
        "capacity_rps": round(capacity, 3), "offered_rps": round(rate, 3),
        "sent": len(records), "ok": sum(r.ok for r in records), "client_skipped": skipped,
        "admitted_rps": round(sum(r.ok for r in records) / args.duration, 3),
        "errors_by_kind": dict(errors),
        "latency_ok": {"e2e_s": percentiles([(r.end_perf_ns - r.start_perf_ns) / 1e9 for r in records
                                              if r.ok and r.end_perf_ns]),
                       "ttft_s": percentiles([(r.chunk_perf_ns[0] - r.start_perf_ns) / 1e9 for r in records
                                              if r.ok and r.chunk_perf_ns])},
        "minutes": [asdict(m) for m in summarize(results)],
        "rss_mb": {label: {"start": rss_start.get(label), "end": rss_end.get(label)} for label in pids},
        "rss_samples_mb": rss_samples,
    }


def print_report(report: dict) -> None:
    print(f"capacity {report['capacity_rps']} req/s, offered {report['offered_rps']} req/s "
          f"({report['load_factor']}x) for {report['duration_s']:.0f} s")
    print(f"sent {report['sent']}, ok {report['ok']} ({report['admitted_rps']} req/s), client-skipped "
          f"{report['client_skipped']}; errors: {report['errors_by_kind']}")
    print(f"{'min':>4} {'sent':>6} {'ok':>6} {'e2e p50':>8} {'e2e p99':>8} {'ttft p50':>9} {'ttft p99':>9} errors")
    for m in report["minutes"]:
        print(f"{m['minute']:>4} {m['sent']:>6} {m['ok']:>6} {m['e2e_s'].get('p50', 0):>8.2f} "
              f"{m['e2e_s'].get('p99', 0):>8.2f} {m['ttft_s'].get('p50', 0):>9.2f} {m['ttft_s'].get('p99', 0):>9.2f} "
              f"{m['errors']}")
    print("RSS MB (start -> end):")
    for label, rss in report["rss_mb"].items():
        print(f"  {label:<32} {rss['start']} -> {rss['end']}")


if __name__ == "__main__":
    main()
