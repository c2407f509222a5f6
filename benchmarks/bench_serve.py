"""The cost of the Ray path: the served app over HTTP against the in-process AsyncEngine, on the same prompts.

Random 256-token prompts, 128 output tokens (ignore_eos), streaming, at concurrency 1, 8 and 32. The app runs in
each of `--variants`: by default make serve's layout (one engine replica holding both CPUs) and two engine
replicas of one CPU and one thread each, each with its ingress replica answering HTTP itself as under `make serve`
(`TOKENLINE_INGRESS=proxy` in a variant: through Serve's proxy), and Ray's processes that serve no request behind
the replicas in CPU priority, as `make serve` runs them (`TOKENLINE_BACKGROUND_NICE=off`: Ray's own priorities).
Prints a table, the CPU each process spent per output token, and writes JSON.

`--timelines on,off --repeats 2` measures the cost of request timelines and the step trace: the app started with
them on, then off, then again, each on the same prompts; the summary compares the mean throughput of each.

    python -m benchmarks.bench_serve --model ~/.cache/tokenline/SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from benchmarks.plot import plot_bars
from loadtests.metrics import percentile
from deployments.config import AppArgs, EngineArgs
from deployments.direct_ingress import INGRESS_ENV
from deployments.node_priority import background_nice
from deployments.timeline_config import TimelineArgs
from engine import AsyncEngine, EngineConfig, SamplingParams

log = logging.getLogger("bench_serve")


@dataclass
class RequestResult:
    ttft_s: float
    gaps_s: list[float]  # between consecutive streamed chunks
    e2e_s: float
    output_tokens: int


@dataclass
class LevelResult:
    path: str  # "engine" or "serve(stream_interval_s=...)"
    concurrency: int
    requests: int
    wall_s: float
    output_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    tpot_p50_s: float
    failures: int = 0
    # CPU time the app's own processes (Serve replicas, proxy, controller) spent per output token: less sensitive
    # than throughput to other work sharing the machine.
    server_cpu_ms_per_token: float = float("nan")
    # The same, by process kind (proxy, ingress, engine, controller, ray: raylet, GCS and other Ray daemons).
    cpu_ms_per_token_by_process: dict[str, float] = field(default_factory=dict)


@dataclass
class Report:
    prompt_tokens: int
    output_tokens: int
    levels: list[LevelResult] = field(default_factory=list)
    ratios: dict[str, dict[int, float]] = field(default_factory=dict)  # serve tok/s over engine tok/s
    timeline_cost: dict[int, float] = field(default_factory=dict)  # 1 - mean tok/s on / mean tok/s off
    timeline_cpu_cost: dict[int, float] = field(default_factory=dict)  # mean CPU/token on / mean off - 1


def summarize(path: str, concurrency: int, results: list[RequestResult | None], wall_s: float) -> LevelResult:
    done = [r for r in results if r is not None]
    gaps = [g for r in done for g in r.gaps_s]
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return LevelResult(path=path, concurrency=concurrency, requests=len(results), wall_s=wall_s,
                       output_tok_s=sum(r.output_tokens for r in done) / wall_s,
                       ttft_p50_s=percentile([r.ttft_s for r in done], 0.5),
                       ttft_p99_s=percentile([r.ttft_s for r in done], 0.99),
                       itl_p50_s=percentile(gaps, 0.5), itl_p99_s=percentile(gaps, 0.99),
                       tpot_p50_s=percentile(tpots, 0.5), failures=len(results) - len(done))


async def run_level(one: Callable[[list[int]], Awaitable[RequestResult | None]], prompts: list[list[int]],
                    concurrency: int) -> tuple[list[RequestResult | None], float]:
    gate = asyncio.Semaphore(concurrency)

    async def gated(prompt: list[int]) -> RequestResult | None:
        async with gate:
            return await one(prompt)

    start = time.perf_counter()
    results = await asyncio.gather(*(gated(p) for p in prompts))
    return list(results), time.perf_counter() - start


def engine_request(engine: AsyncEngine, output_tokens: int) -> Callable[[list[int]], Awaitable[RequestResult]]:
    async def one(prompt: list[int]) -> RequestResult:
        params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        times, tokens = [], 0
        async for out in engine.generate(prompt, params):
            if out.new_token_ids:
                times.append(time.perf_counter())
                tokens += len(out.new_token_ids)
        return RequestResult(times[0] - start, [b - a for a, b in zip(times, times[1:])], times[-1] - start, tokens)
    return one


def http_request(session: aiohttp.ClientSession, base_url: str, model: str,
                 output_tokens: int) -> Callable[[list[int]], Awaitable[RequestResult | None]]:
    async def one(prompt: list[int]) -> RequestResult | None:
        body = {"model": model, "prompt": prompt, "max_tokens": output_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        times, tokens = [], 0
        async with session.post(f"{base_url}/v1/completions", json=body) as response:
            if response.status != 200:
                log.warning("request failed: %s %s", response.status, await response.text())
                return None
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if any(c.get("text") for c in event.get("choices", [])):
                    times.append(time.perf_counter())
        if not times:
            return None
        return RequestResult(times[0] - start, [b - a for a, b in zip(times, times[1:])], times[-1] - start, tokens)
    return one


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def requests_for(concurrency: int) -> int:
    return max(4, 2 * concurrency)


async def bench_engine(config: EngineConfig, prompt_sets: dict[int, list[list[int]]], output_tokens: int,
                       warmup: list[list[int]]) -> list[LevelResult]:
    engine = AsyncEngine(config)
    try:
        one = engine_request(engine, output_tokens)
        await run_level(one, warmup, len(warmup))
        out = []
        for concurrency, prompts in prompt_sets.items():
            cpu_before = time.process_time()
            results, wall = await run_level(one, prompts, concurrency)
            level = summarize("engine", concurrency, results, wall)
            tokens = max(sum(r.output_tokens for r in results if r is not None), 1)
            level.server_cpu_ms_per_token = (time.process_time() - cpu_before) * 1e3 / tokens
            out.append(level)
            log.info("%s", out[-1])
        return out
    finally:
        engine.shutdown()


SERVE_PROCESSES = {"ray::ServeReplica:tokenline:EngineReplica": "engine", "ray::ServeReplica:tokenline:OpenAIIngress":
                   "ingress", "ray::ProxyActor": "proxy", "ray::ServeController": "controller"}


def process_kind(cmdline: list[str]) -> str | None:
    """Which part of the app a child process of this one is; "ray" for Ray's own daemons, None for the rest."""
    if not cmdline:
        return None
    for prefix, kind in SERVE_PROCESSES.items():
        if cmdline[0].startswith(prefix):
            return kind
    joined = " ".join(cmdline[:3])
    return "ray" if any(d in joined for d in ("raylet", "gcs_server", "dashboard", "log_monitor", "ray::")) else None


def app_cpu_seconds_by_process() -> dict[str, float]:
    """CPU time used so far by this process's own Ray cluster (its children), by process kind."""
    import psutil

    totals: dict[str, float] = {}
    for child in psutil.Process().children(recursive=True):
        try:
            kind = process_kind(child.cmdline())
            if kind is not None:
                times = child.cpu_times()
                totals[kind] = totals.get(kind, 0.0) + times.user + times.system
        except psutil.Error:  # gone meanwhile
            continue
    return totals


async def bench_http(base_url: str, model: str, label: str, prompt_sets: dict[int, list[list[int]]],
                     output_tokens: int, warmup: list[list[int]]) -> list[LevelResult]:
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=256)) as session:
        one = http_request(session, base_url, model, output_tokens)
        await run_level(one, warmup, len(warmup))
        out = []
        for concurrency, prompts in prompt_sets.items():
            cpu_before = app_cpu_seconds_by_process()
            results, wall = await run_level(one, prompts, concurrency)
            cpu_after = app_cpu_seconds_by_process()
            level = summarize(label, concurrency, results, wall)
            tokens = max(sum(r.output_tokens for r in results if r is not None), 1)
            level.cpu_ms_per_token_by_process = {k: (v - cpu_before.get(k, 0.0)) * 1e3 / tokens
                                                 for k, v in sorted(cpu_after.items())}
            level.server_cpu_ms_per_token = sum(v for k, v in level.cpu_ms_per_token_by_process.items()
                                                if k != "ray")
            out.append(level)
            log.info("%s", out[-1])
        return out


def print_table(report: Report) -> None:
    print(f"\n{'path':<44} {'conc':>4} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
          f"{'ITL p99':>8} {'TPOT p50':>9} {'fail':>4} {'CPU ms/tok':>10}")
    for r in report.levels:
        print(f"{r.path:<44} {r.concurrency:>4} {r.output_tok_s:>10.1f} {r.ttft_p50_s:>9.3f} {r.ttft_p99_s:>9.3f} "
              f"{r.itl_p50_s:>8.3f} {r.itl_p99_s:>8.3f} {r.tpot_p50_s:>9.4f} {r.failures:>4} "
              f"{r.server_cpu_ms_per_token:>10.2f}")
    for r in report.levels:
        if r.cpu_ms_per_token_by_process:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in r.cpu_ms_per_token_by_process.items())
            print(f"CPU ms per output token, {r.path} c={r.concurrency}: {parts}")
    for label, by_level in report.ratios.items():
        ratios = ", ".join(f"c={c}: {ratio:.0%}" for c, ratio in by_level.items())
        print(f"{label} / engine throughput: {ratios}")
    if report.timeline_cost:
        costs = ", ".join(f"c={c}: {cost:+.1%}" for c, cost in report.timeline_cost.items())
        print(f"throughput cost of timelines and the step trace (mean on vs mean off): {costs}")
    if report.timeline_cpu_cost:
        costs = ", ".join(f"c={c}: {cost:+.1%}" for c, cost in report.timeline_cpu_cost.items())
        print(f"server CPU per token, timelines on vs off (mean): {costs}")


def timeline_cost(levels: list[LevelResult], metric: str, higher_is_better: bool) -> dict[int, float]:
    """Per concurrency, what timelines cost in `metric`: the mean with them on against the mean with them off."""
    def mean(state: str, concurrency: int) -> float | None:
        runs = [getattr(r, metric) for r in levels if f"timeline={state}" in r.path and r.concurrency == concurrency]
        return statistics.mean(runs) if runs else None

    costs = {}
    for concurrency in sorted({r.concurrency for r in levels}):
        on, off = mean("on", concurrency), mean("off", concurrency)
        if on is not None and off:
            costs[concurrency] = 1 - on / off if higher_is_better else on / off - 1
    return costs


def parse_variant(spec: str) -> tuple[str, dict[str, str], dict[str, object]]:
    """NAME[:KEY=VALUE...] -> (name, environment variables, AppArgs overrides)."""
    import yaml

    name, *pairs = spec.split(":")
    items = [p.split("=", 1) for p in pairs]
    return (name, {k: v for k, v in items if k.isupper()},
            {k: yaml.safe_load(v) for k, v in items if not k.isupper()})


def with_overrides(fields: dict, overrides: dict[str, object]) -> dict:
    """AppArgs fields with `overrides` applied; a dotted key reaches a nested field (engine.num_threads)."""
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = fields
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return fields


@contextlib.contextmanager
def environment(env: dict[str, str]):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--stream-intervals", default="0", help="comma-separated stream_interval_s values to try")
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs of the one engine replica (and its threads)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=EngineArgs().max_num_batched_tokens,
                        help="the engine's token budget per step (prefill chunk size): lower evens out ITL")
    parser.add_argument("--timelines", default="on", help="comma-separated on/off: serve with request timelines "
                                                           "and the step trace on, off, or both in turn")
    parser.add_argument("--repeats", type=int, default=1, help="how many times to serve each configuration, "
                                                               "alternating them")
    parser.add_argument("--variants", nargs="+",
                        default=["1x2", "2x1:num_engine_replicas=2:engine_num_cpus=1:engine.num_threads=1"],
                        help="serve configurations to compare (default: make serve's one replica of --num-cpus, and "
                             "two engine replicas of one CPU), each NAME[:KEY=VALUE...]: an upper-case KEY is an "
                             "environment variable of the app's processes, a lower-case one an AppArgs field, "
                             "dotted for nested ones (num_engine_replicas=2:engine_num_cpus=1:engine.num_threads=1)")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("results/bench_serve.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from deployments import local

    levels = [int(c) for c in args.concurrency.split(",")]
    vocab = 49152
    prompt_sets = {c: make_prompts(requests_for(c), args.prompt_tokens, vocab, seed=c) for c in levels}
    warmup = make_prompts(2, args.prompt_tokens, vocab, seed=999)
    report = Report(prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens)
    engine_args = EngineArgs(dtype=args.dtype, num_threads=args.num_cpus,
                             max_num_batched_tokens=args.max_num_batched_tokens)
    if not args.skip_engine:
        config = AppArgs(model=args.model, engine=engine_args, engine_num_cpus=args.num_cpus).engine_config()
        report.levels += asyncio.run(bench_engine(config, prompt_sets, args.output_tokens, warmup))
    configs = [(float(interval), timeline) for interval in args.stream_intervals.split(",")
               for timeline in args.timelines.split(",")]
    variants = [parse_variant(v) for v in args.variants]
    for repeat in range(1, args.repeats + 1):
        for (interval, timeline), (name, env, overrides) in itertools.product(configs, variants):
            label = f"serve(stream_interval={interval:g}s, timeline={timeline})"
            label += f" {name}" if len(variants) > 1 else ""
            label += f" #{repeat}" if args.repeats > 1 else ""
            app_args = AppArgs(model=args.model, num_engine_replicas=1, engine_num_cpus=args.num_cpus,
                               ingress_max_replicas=1, stream_interval_s=interval, engine=engine_args,
                               timeline=TimelineArgs(enabled=timeline == "on"))
            app_args = AppArgs.model_validate(with_overrides(app_args.model_dump(), overrides))
            # As `make serve`: the ingress replica answers HTTP itself unless TOKENLINE_INGRESS=proxy.
            direct = (env.get(INGRESS_ENV, os.environ.get(INGRESS_ENV, "direct")) == "direct"
                      and app_args.ingress_max_replicas == 1)
            # And as `make serve`, Ray's processes that serve no request run behind the replicas unless
            # TOKENLINE_BACKGROUND_NICE=off (deployments.node_priority).
            with environment(env):  # Ray's processes inherit the environment of the one that starts them
                served = local.start(app_args, num_cpus=args.num_cpus, direct_ingress=direct,
                                     background_nice=background_nice())
            try:
                report.levels += asyncio.run(bench_http(served.base_url, served.model, label, prompt_sets,
                                                        args.output_tokens, warmup))
            finally:
                served.stop()
    report.timeline_cost = timeline_cost(report.levels, "output_tok_s", higher_is_better=True)
    report.timeline_cpu_cost = timeline_cost(report.levels, "server_cpu_ms_per_token", higher_is_better=False)
    engine_tok_s = {r.concurrency: r.output_tok_s for r in report.levels if r.path == "engine"}
    for r in report.levels:
        if r.path != "engine" and r.concurrency in engine_tok_s:
            report.ratios.setdefault(r.path, {})[r.concurrency] = r.output_tok_s / engine_tok_s[r.concurrency]
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(asdict(report), indent=2))
    png = plot_bars([asdict(r) for r in report.levels], "concurrency", "path",
                    {"output_tok_s": "output tokens/s", "ttft_p50_s": "TTFT p50 (s)", "itl_p50_s": "ITL p50 (s)"},
                    args.out.with_suffix(".png"), title="in-process engine against the served app")
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
