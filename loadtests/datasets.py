"""Request sources: synthetic lengths, shared-prefix synthetic, and Mooncake trace replay."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadtests.prompts import PromptBuilder
from loadtests.records import RequestSpec

log = logging.getLogger(__name__)

MOONCAKE_BLOCK_SIZE = 512  # tokens per hash id in the Mooncake traces (and AIPerf's default)
# Mooncake's synthetic trace (Apache-2.0, its licence beside it): 3,993 requests over 17 minutes.
MOONCAKE_TRACE = Path(__file__).parent / "traces" / "mooncake_synthetic_trace.jsonl"


def sample_lengths(rng: np.random.Generator, mean: int, stddev: float, n: int) -> list[int]:
    """Positive integer lengths from a normal distribution (AIPerf's sample_positive_normal_integer)."""
    if stddev <= 0:
        return [max(1, int(mean))] * n
    return [max(1, int(round(x))) for x in rng.normal(mean, stddev, size=n)]


@dataclass(frozen=True)
class SyntheticConfig:
    num_requests: int
    input_mean: int = 256
    input_std: float = 0.0
    output_mean: int = 128
    output_std: float = 0.0
    seed: int = 0


def synthetic_specs(builder: PromptBuilder, cfg: SyntheticConfig, first_index: int = 0) -> list[RequestSpec]:
    rng = np.random.default_rng([cfg.seed, first_index])
    inputs = sample_lengths(rng, cfg.input_mean, cfg.input_std, cfg.num_requests)
    outputs = sample_lengths(rng, cfg.output_mean, cfg.output_std, cfg.num_requests)
    prompts = builder.texts([builder.random_tokens(n) for n in inputs])
    return [RequestSpec(first_index + i, p.text, p.num_tokens, o) for i, (p, o) in enumerate(zip(prompts, outputs))]


@dataclass(frozen=True)
class SharedPrefixConfig:
    """N distinct prefixes of P tokens; each request is one prefix (round-robin) plus its own S-token suffix."""

    num_requests: int
    num_prefixes: int = 4
    prefix_len: int = 256
    suffix_len: int = 64
    output_mean: int = 128
    output_std: float = 0.0
    seed: int = 0


def shared_prefix_specs(builder: PromptBuilder, cfg: SharedPrefixConfig, first_index: int = 0) -> list[RequestSpec]:
    rng = np.random.default_rng([cfg.seed, first_index, 1])
    outputs = sample_lengths(rng, cfg.output_mean, cfg.output_std, cfg.num_requests)
    token_lists, prefix_ids = [], []
    for i in range(cfg.num_requests):
        prefix = (first_index + i) % cfg.num_prefixes
        token_lists.append(builder.block(-1 - prefix, cfg.prefix_len) + builder.random_tokens(cfg.suffix_len))
        prefix_ids.append(prefix)
    prompts = builder.texts(token_lists)
    return [RequestSpec(first_index + i, p.text, p.num_tokens, o, hash_ids=(-1 - k,))
            for i, (p, o, k) in enumerate(zip(prompts, outputs, prefix_ids))]


@dataclass(frozen=True)
class TraceRow:
    """One line of a Mooncake trace: arrival (ms since the trace start), lengths, and one hash id per block."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path) -> list[TraceRow]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            try:
                rows.append(TraceRow(float(obj.get("timestamp", 0)), int(obj["input_length"]),
                                     int(obj["output_length"]), tuple(int(h) for h in obj.get("hash_ids", ()))))
            except KeyError as exc:
                raise ValueError(f"{path}:{n}: a Mooncake trace line needs {exc.args[0]!r}") from None
    return rows


@dataclass(frozen=True)
class TraceConfig:
    block_size: int = MOONCAKE_BLOCK_SIZE  # tokens per hash id in the prompts we send
    trace_block_size: int = MOONCAKE_BLOCK_SIZE  # tokens per hash id when the trace was recorded
    time_scale: float = 1.0  # multiplies the gaps between arrivals (0.5: twice as fast)
    start_ms: float | None = None  # window on the trace's own clock
    end_ms: float | None = None
    max_requests: int | None = None  # the first N rows of the window
    max_output_tokens: int | None = None  # cap on each row's output length


def scaled_input_length(row: TraceRow, block_size: int, trace_block_size: int) -> int:
    """The row's input length at another block size: whole blocks stay whole, the last block scales."""
    n = len(row.hash_ids)
    if n == 0:
        return max(1, round(row.input_length * block_size / trace_block_size))
    last = min(max(row.input_length - (n - 1) * trace_block_size, 1), trace_block_size)
    return (n - 1) * block_size + min(block_size, max(1, round(last * block_size / trace_block_size)))


def trace_window(rows: list[TraceRow], cfg: TraceConfig) -> list[TraceRow]:
    chosen = [r for r in rows if (cfg.start_ms is None or r.timestamp_ms >= cfg.start_ms)
              and (cfg.end_ms is None or r.timestamp_ms < cfg.end_ms)]
    return chosen[: cfg.max_requests] if cfg.max_requests is not None else chosen


def trace_specs(builder: PromptBuilder, rows: list[TraceRow], cfg: TraceConfig) -> list[RequestSpec]:
    """Requests in trace order, each with its send offset: (timestamp - first timestamp) * time_scale."""
    rows = trace_window(rows, cfg)
    if not rows:
        raise ValueError("the trace window holds no requests")
    t0 = rows[0].timestamp_ms
    token_lists = []
    for row in rows:
        n = scaled_input_length(row, cfg.block_size, cfg.trace_block_size)
        token_lists.append(builder.hashed_tokens(row.hash_ids, n, cfg.block_size) if row.hash_ids
                           else builder.random_tokens(n))
    prompts = builder.texts(token_lists)
    specs = []
    for i, (row, prompt) in enumerate(zip(rows, prompts)):
        out = row.output_length if cfg.max_output_tokens is None else min(row.output_length, cfg.max_output_tokens)
        specs.append(RequestSpec(i, prompt.text, prompt.num_tokens, max(1, out),
                                 send_offset_s=(row.timestamp_ms - t0) / 1000.0 * cfg.time_scale,
                                 hash_ids=row.hash_ids, trace_timestamp_ms=row.timestamp_ms))
    log.info("trace: %d requests over %.1f s (time scale %g), %d-token blocks", len(specs),
             specs[-1].send_offset_s or 0.0, cfg.time_scale, cfg.block_size)
    return specs
