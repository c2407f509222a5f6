"""Prefix-aware routing against Ray Serve's default router: the same requests, the same seed, one run.

For each router policy the app starts with 2 engine replicas, then `python -m loadtests.bench` drives each
workload against it: the shared-prefix synthetic set (prefixes interleaved round-robin, more of them than one
replica's KV pool holds) and a window of the Mooncake trace scaled to this model (small block size, replayed on
its own clock). Prints hit rate, TTFT and ITL p50/p99, output tokens/s and errors per workload and router, and
writes them as JSON; each run's AIPerf files land under --artifact-dir.

    python -m benchmarks.bench_router --model ~/.cache/tokenline/SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.plot import plot_bars
from deployments.config import AppArgs
from deployments.router_config import RouterArgs
from loadtests.datasets import MOONCAKE_TRACE

log = logging.getLogger("bench_router")

POLICIES = ("prefix_aware", "power_of_two")


@dataclass
class Row:
    workload: str
    policy: str
    requests: int
    errors: int
    hit_rate_pct: float  # prompt tokens the server reported as cached, of all prompt tokens
    engine_hit_rate_pct: float  # the engines' own prefix-cache counters over the run
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    output_tok_s: float


def workloads(args: argparse.Namespace) -> dict[str, list[str]]:
    common = ["--endpoint", "completions", "--ignore-eos", "--seed", str(args.seed), "--no-progress"]
    return {
        "shared-prefix": common + [
            "--dataset", "shared-prefix", "--num-prefixes", str(args.num_prefixes), "--prefix-len",
            str(args.prefix_len), "--suffix-len", "32", "--osl", "16", "--concurrency", str(args.concurrency),
            "--num-requests", str(args.num_requests)],
        "mooncake": common + [
            "--dataset", "trace", "--trace", str(args.trace), "--block-size", "8", "--max-output-tokens", "16",
            "--trace-start-ms", str(args.trace_start_ms), "--trace-end-ms", str(args.trace_end_ms),
            "--time-scale", str(args.time_scale), "--concurrency", "64"],
    }


def run_workload(app, name: str, policy: str, flags: list[str], artifact_dir: Path) -> Row:
    before = app.engine_replica_stats()
    out = artifact_dir / name / policy
    cmd = [sys.executable, "-m", "loadtests.bench", "--url", app.base_url, "--model", app.model,
           "--artifact-dir", str(out), *flags]
    log.info("%s · %s: %s", name, policy, " ".join(cmd[1:]))
    subprocess.run(cmd, check=True, timeout=1800)
    after = app.engine_replica_stats()
    queries = sum(s.prefix_cache_queries for s in after) - sum(s.prefix_cache_queries for s in before)
    hits = sum(s.prefix_cache_hits for s in after) - sum(s.prefix_cache_hits for s in before)
    doc = json.loads((out / "profile_export_aiperf.json").read_text())
    value = lambda tag, stat="avg": float((doc.get(tag) or {}).get(stat) or 0.0)  # noqa: E731
    return Row(name, policy, int(value("request_count")), int(value("error_request_count")),
               value("overall_usage_prompt_cache_read_pct"), 100.0 * hits / max(queries, 1),
               value("time_to_first_token", "p50"), value("time_to_first_token", "p99"),
               value("inter_token_latency", "p50"), value("inter_token_latency", "p99"),
               value("output_token_throughput"))


def render(rows: list[Row]) -> str:
    header = (f"{'workload':<14}{'router':<14}{'reqs':>5}{'err':>5}{'hit %':>8}{'engine %':>10}{'TTFT p50':>10}"
              f"{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'out tok/s':>11}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r.workload:<14}{r.policy:<14}{r.requests:>5}{r.errors:>5}{r.hit_rate_pct:>8.1f}"
                     f"{r.engine_hit_rate_pct:>10.1f}{r.ttft_p50_ms:>10.0f}{r.ttft_p99_ms:>10.0f}"
                     f"{r.itl_p50_ms:>9.1f}{r.itl_p99_ms:>9.1f}{r.output_tok_s:>11.1f}")
    for name in dict.fromkeys(r.workload for r in rows):
        ours = next((r for r in rows if r.workload == name and r.policy == "prefix_aware"), None)
        base = next((r for r in rows if r.workload == name and r.policy == "power_of_two"), None)
        if ours and base:
            lines.append(f"{name}: hit rate x{ours.hit_rate_pct / max(base.hit_rate_pct, 1e-9):.2f}, "
                         f"TTFT p50 x{ours.ttft_p50_ms / max(base.ttft_p50_ms, 1e-9):.2f}, "
                         f"output tok/s x{ours.output_tok_s / max(base.output_tok_s, 1e-9):.2f} "
                         "(prefix_aware / power_of_two)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-kv-blocks", type=int, default=640, help="per engine replica (16 tokens each)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--workloads", default="shared-prefix,mooncake")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--num-prefixes", type=int, default=31,
                        help="odd: with an even count, 2 replicas served in turn would each see the same prefixes")
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--trace", type=Path, default=MOONCAKE_TRACE)
    parser.add_argument("--trace-start-ms", type=float, default=975398)
    parser.add_argument("--trace-end-ms", type=float, default=1005398)
    parser.add_argument("--time-scale", type=float, default=2.0)
    parser.add_argument("--artifact-dir", type=Path, default=Path("results/bench_router"))
    parser.add_argument("--out", type=Path, default=Path("results/bench_router.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from deployments import local

    chosen = {name: flags for name, flags in workloads(args).items() if name in args.workloads.split(",")}
    rows: list[Row] = []
    for policy in args.policies.split(","):
        app_args = AppArgs(model=args.model, num_engine_replicas=2, engine_num_cpus=1, ingress_max_replicas=1,
                           num_kv_blocks=args.num_kv_blocks, router=RouterArgs(policy=policy))
        app = local.start(app_args, num_cpus=2)
        try:
            rows += [run_workload(app, name, policy, flags, args.artifact_dir) for name, flags in chosen.items()]
        finally:
            app.stop()
    print(render(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()},
                                    "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    png = plot_bars([asdict(r) for r in rows], "workload", "policy",
                    {"hit_rate_pct": "prefix-cache hit rate (%)", "ttft_p50_ms": "TTFT p50 (ms)",
                     "output_tok_s": "output tokens/s"}, args.out.with_suffix(".png"), title="router policies")
    log.info("wrote %s and %s", args.out, png)


if __name__ == "__main__":
    main()
