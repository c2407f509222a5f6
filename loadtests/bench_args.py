"""Command-line options of `python -m loadtests.bench` (names follow AIPerf and `vllm bench serve` where they can)."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from loadtests.datasets import MOONCAKE_BLOCK_SIZE

T = TypeVar("T")


def parse_list(values: list[str] | None, kind: Callable[[str], T]) -> list[T]:
    """`--concurrency 1,4 --concurrency 16` → [1, 4, 16]."""
    return [kind(v) for item in values or () for v in item.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench",
                                description="Benchmark an OpenAI-compatible server: latency, throughput, goodput.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("endpoint")
    g.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    g.add_argument("--model", "-m", help="model name (default: the first one /v1/models lists)")
    g.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    g.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--no-streaming", action="store_true", help="ask for whole responses (no TTFT/ITL)")
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so every request makes max_tokens")
    g.add_argument("--extra-body", help='JSON merged into every request body, e.g. \'{"temperature": 0}\'')
    g.add_argument("--tokenizer", help="HF tokenizer folder or GGUF file for exact prompt lengths "
                                       "(default: the default model's GGUF in $TOKENLINE_CACHE)")

    g = p.add_argument_group("load")
    g.add_argument("--concurrency", action="append", help="requests in flight; a list (1,4,16) sweeps; "
                                                          "with --request-rate or a trace schedule, a cap")
    g.add_argument("--request-rate", action="append", help="requests/s; a list (1,2,4) sweeps")
    g.add_argument("--arrival", choices=("constant", "poisson", "gamma"), default="poisson",
                   help="arrival process for --request-rate")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape for --arrival gamma: <1 burstier, 1 Poisson, >1 more regular")
    g.add_argument("--num-requests", "--request-count", type=int, help="profiling requests per point")
    g.add_argument("--duration", type=float, help="seconds per point; no new requests after it")
    g.add_argument("--warmup-requests", type=int, default=0, help="sent first, left out of the statistics")
    g.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds in-flight requests may run past --duration before they are cancelled")
    g.add_argument("--request-timeout", type=float, default=600.0)
    g.add_argument("--seed", type=int, help="seed of prompts and arrivals (default: a new one each run, printed and "
                                            "saved, so no run finds its prompts already in the server's prefix "
                                            "cache; give the same one to repeat a run exactly)")

    g = p.add_argument_group("input")
    g.add_argument("--dataset", choices=("synthetic", "shared-prefix", "trace"), default="synthetic")
    g.add_argument("--input-tokens-mean", "--isl", type=int, default=256)
    g.add_argument("--input-tokens-stddev", type=float, default=0.0)
    g.add_argument("--output-tokens-mean", "--osl", type=int, default=128)
    g.add_argument("--output-tokens-stddev", type=float, default=0.0)
    g.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    g.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens per prefix")
    g.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: unique tokens after the prefix")
    g.add_argument("--trace", help="Mooncake trace (JSONL: timestamp ms, input_length, output_length, hash_ids)")
    g.add_argument("--block-size", type=int, default=MOONCAKE_BLOCK_SIZE,
                   help="tokens per hash id in the prompts sent; below the trace's own size it scales the trace "
                        "down and keeps its prefix structure")
    g.add_argument("--trace-block-size", type=int, default=MOONCAKE_BLOCK_SIZE,
                   help="tokens per hash id when the trace was recorded")
    g.add_argument("--time-scale", type=float, default=1.0, help="multiplies the trace's gaps (0.5: twice as fast)")
    g.add_argument("--trace-start-ms", type=float, help="replay window start, on the trace's clock")
    g.add_argument("--trace-end-ms", type=float, help="replay window end, on the trace's clock")
    g.add_argument("--max-output-tokens", type=int, help="cap on the trace's output lengths")
    g.add_argument("--no-fixed-schedule", action="store_true",
                   help="replay a trace under --concurrency/--request-rate instead of its own timestamps")

    g = p.add_argument_group("results")
    g.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:VALUE",
                   help="SLOs, e.g. time_to_first_token:200 inter_token_latency:50 (ms; a request is good only "
                        "if it meets all)")
    g.add_argument("--artifact-dir", help="where the files go (default: results/bench/MODEL-ENDPOINT)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--verbose", "-v", action="store_true")
    return p
