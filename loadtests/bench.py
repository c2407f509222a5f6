"""`python -m loadtests.bench`: benchmark an OpenAI-compatible server, AIPerf-style.

    python -m loadtests.bench --url http://127.0.0.1:8000 --concurrency 1,4,16 --num-requests 64 \\
        --input-tokens-mean 256 --output-tokens-mean 128 --ignore-eos \\
        --goodput "time_to_first_token:2000 inter_token_latency:100"
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp

from loadtests.arrivals import LoadMode
from loadtests.bench_args import build_parser, parse_list
from loadtests.console import render_run, render_sweep
from loadtests.datasets import TraceConfig
from loadtests.export import write_exports
from loadtests.inputs import InputConfig, build_specs, build_warmup
from loadtests.metrics import SLO
from loadtests.openai_api import EndpointConfig
from loadtests.plot import plot_sweep
from loadtests.prompts import PromptBuilder, word_token_ids
from loadtests.runner import RunLimits, RunResult, run_load
from loadtests.summary import RunSummary, summarize
from loadtests.tokenizer import load_tokenizer

log = logging.getLogger("loadtests.bench")


def load_modes(args: argparse.Namespace) -> list[LoadMode]:
    """One mode per sweep point: rates (capped by one concurrency), a trace schedule, or concurrencies."""
    concurrencies = parse_list(args.concurrency, int)
    rates = parse_list(args.request_rate, float)
    fixed = args.dataset == "trace" and not args.no_fixed_schedule and not rates
    if (rates or fixed) and len(concurrencies) > 1:
        raise SystemExit("with --request-rate or a trace schedule, --concurrency is a cap: give one value")
    cap = concurrencies[0] if concurrencies else None
    common = dict(arrival=args.arrival, burstiness=args.burstiness, seed=args.seed)
    if rates:
        return [LoadMode(concurrency=cap, rate=r, **common) for r in rates]
    if fixed:
        return [LoadMode(concurrency=cap, trace=True, **common)]
    return [LoadMode(concurrency=c, **common) for c in (concurrencies or [1])]


def input_config(args: argparse.Namespace) -> InputConfig:
    trace = TraceConfig(args.block_size, args.trace_block_size, args.time_scale, args.trace_start_ms,
                        args.trace_end_ms, None, args.max_output_tokens)
    return InputConfig(args.dataset, args.input_tokens_mean, args.input_tokens_stddev, args.output_tokens_mean,
                       args.output_tokens_stddev, args.num_prefixes, args.prefix_len, args.suffix_len,
                       Path(args.trace) if args.trace else None, trace, args.seed)


async def discover_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(base_url.rstrip("/") + "/v1/models", headers=headers) as resp:
            if resp.status != 200:
                raise SystemExit(f"GET /v1/models answered {resp.status}; pass --model")
            models = (await resp.json()).get("data") or []
    if not models:
        raise SystemExit(f"{base_url} serves no models; pass --model")
    return models[0]["id"]


def run_point(args: argparse.Namespace, endpoint: EndpointConfig, mode: LoadMode, builder: PromptBuilder,
              inputs: InputConfig) -> tuple[RunSummary, RunResult]:
    specs = build_specs(builder, inputs, args.num_requests)
    # no count and no duration (a trace replay): every request of the trace window
    count = args.num_requests if args.num_requests is not None or args.duration is not None else len(specs)
    limits = RunLimits(count, args.duration, args.grace_period, args.request_timeout)
    warmup = build_warmup(builder, inputs, args.warmup_requests)
    result = asyncio.run(run_load(endpoint, mode, specs, limits, warmup, progress=not args.no_progress))
    summary = summarize(result.records, [SLO.parse(s) for item in args.goodput for s in item.split()], builder.count, result.client_cpu_s)
    return summary, result


def default_limits(args: argparse.Namespace, modes: list[LoadMode]) -> None:
    """A run with neither a count nor a duration gets a count: the trace window, or 10 per concurrent stream."""
    if args.num_requests is None and args.duration is None and args.dataset != "trace":
        args.num_requests = max(10, 10 * max((m.concurrency or 1) for m in modes))


def input_config_doc(args: argparse.Namespace, endpoint: EndpointConfig, inputs: InputConfig, mode: LoadMode,
                     cli: str) -> dict[str, Any]:
    """The run's settings, as AIPerf's `input_config` block."""
    return {"endpoint": {"model_names": [endpoint.model], "type": endpoint.endpoint, "streaming": endpoint.streaming,
                         "url": endpoint.base_url, "ignore_eos": endpoint.ignore_eos, "extra_body": endpoint.extra_body},
            "input": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(inputs).items()},
            "loadgen": asdict(mode) | {"request_count": args.num_requests, "duration_s": args.duration,
                                       "warmup_request_count": args.warmup_requests},
            "cli_command": cli}


def sweep_doc(points: list[tuple[str, RunSummary]]) -> list[dict[str, Any]]:
    return [{"label": label, "request_count": s.request_count, "error_request_count": s.error_count,
             "request_throughput": s.value("request_throughput"),
             "output_token_throughput": s.value("output_token_throughput"),
             "time_to_first_token": {k: s.value("time_to_first_token", k) for k in ("p50", "p90", "p99")},
             "inter_token_latency": {k: s.value("inter_token_latency", k) for k in ("p50", "p90", "p99")},
             "goodput": s.value("goodput"), "client_cpu_ms_per_request": s.client_cpu_ms_per_request}
            for label, s in points]


def setup(args: argparse.Namespace, argv: list[str] | None) -> tuple[EndpointConfig, str]:
    """The endpoint (asking the server for its model when none is given) and the redacted command line."""
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    model = args.model or asyncio.run(discover_model(args.url, api_key))
    extra = json.loads(args.extra_body) if args.extra_body else {}
    endpoint = EndpointConfig(args.url, model, args.endpoint, api_key, not args.no_streaming, args.ignore_eos, extra)
    cli = "python -m loadtests.bench " + shlex.join(argv if argv is not None else sys.argv[1:])
    return endpoint, cli.replace(api_key, "<redacted>") if api_key else cli


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop  # a faster event loop keeps the client's own CPU time down
        uvloop.install()
    except ImportError:
        pass
    if args.seed is None:
        args.seed = secrets.randbelow(2**31)
    log.info("seed %d (--seed %d repeats this run's prompts and arrivals)", args.seed, args.seed)
    modes = load_modes(args)
    default_limits(args, modes)
    endpoint, cli = setup(args, argv)
    inputs = input_config(args)
    tokenizer = load_tokenizer(args.tokenizer)
    vocab = word_token_ids(tokenizer)
    base = Path(args.artifact_dir or Path("results") / "bench" / f"{endpoint.model.replace('/', '_')}-{args.endpoint}")
    title = f"{endpoint.model} · {args.endpoint}"
    points: list[tuple[str, RunSummary]] = []
    for i, mode in enumerate(modes):
        builder = PromptBuilder(tokenizer, args.seed + i, vocab)  # each point its own prompts: no cross-point cache hits
        summary, result = run_point(args, endpoint, mode, builder, inputs)
        out_dir = base / mode.label if len(modes) > 1 else base
        run_info = {"random_seed": args.seed + i, "trial": 0, "run_label": mode.label,
                    "variation_label": mode.label if len(modes) > 1 else "base", "variation_index": i,
                    "variation_values": {"concurrency": mode.concurrency, "request_rate": mode.rate},
                    "cli_command": cli}
        write_exports(out_dir, summary, result.records, input_config_doc(args, endpoint, inputs, mode, cli), run_info,
                      result.start_ns, result.end_ns, result.was_cancelled)
        print(render_run(summary, f"\n{title} · {mode.label} → {out_dir}"))
        if result.warmup:
            print(f"Warm-up: {len(result.warmup)} requests, {sum(not r.ok for r in result.warmup)} failed "
                  f"(not in the statistics)")
        points.append((mode.label, summary))
    if len(points) > 1:
        print("\n" + render_sweep(points))
    print(f"plot: {plot_sweep(points, base / 'sweep.png', title)}")
    (base / "sweep.json").write_text(json.dumps(sweep_doc(points), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
