"""int8 against bf16 weights in the native CPU linear kernel, by rows of x: where `quantization: int8` pays.

Every linear of SmolLM2-135M's 30 decoder layers on random weights (qkv 576 -> 960, o 576 -> 576, gate/up 576 ->
3072, down 1536 -> 576), packed once as bf16 (`packed_linear`) and once as int8 (`packed_linear_int8`), timed in
turn at each row count: each round runs all layers once per kernel, alternately, and the table gives each kernel's
median and the ratio of the medians. The weights (212 MB in bf16) do not fit in cache, so a few rows stream them
from memory, as a decode step does. `engine.kernels.native_int8_max_rows()` is where the engine switches (8 with
AVX512-VNNI, 32 with AVX2); this shows why on the CPU at hand.

    python -m benchmarks.int8_linear --rows 1,2,4,8,16,32,48

Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.kernel_ab import LAYERS, LINEAR_SHAPES
from engine.kernels import native_int8_available, native_int8_max_rows
from engine.models.layers import quantize_int8


def build_layers(layers: int, seed: int = 0) -> list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(out, in, bf16 packed, int8 packed, int8 scales) for each linear of `layers` decoder layers."""
    generator = torch.Generator().manual_seed(seed)
    built = []
    for _ in range(layers):
        for n, k in LINEAR_SHAPES:
            weight = (torch.randn(n, k, generator=generator) * 0.05).to(torch.bfloat16)
            built.append((n, k, torch.ops.tokenline.pack_linear_weight(weight), *quantize_int8(weight)))
    return built


def time_rows(built, rows: int, rounds: int) -> tuple[list[float], list[float]]:
    """Seconds for all of `built` at `rows` rows, bf16 then int8, alternately, `rounds` times each."""
    xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {k for _, k, *_ in built}}
    outs = {n: torch.empty(rows, n, dtype=torch.bfloat16) for n in {n for n, *_ in built}}

    def run(int8: bool) -> float:
        start = time.perf_counter()
        for n, k, packed, packed_int8, scales in built:
            if int8:
                torch.ops.tokenline.packed_linear_int8(outs[n], xs[k], packed_int8, scales, None, n)
            else:
                torch.ops.tokenline.packed_linear(outs[n], xs[k], packed, None, n)
        return time.perf_counter() - start

    run(False), run(True)  # warm-up: thread pool, scratch buffers
    bf16, int8 = [], []
    for _ in range(rounds):
        bf16.append(run(False))
        int8.append(run(True))
    return bf16, int8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,32,48")
    parser.add_argument("--rounds", type=int, default=30, help="alternating rounds at each row count")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: this process's CPUs)")
    parser.add_argument("--out", default="results/int8_linear.json")
    args = parser.parse_args()
    if not native_int8_available():
        raise SystemExit("int8 linears need the native CPU kernels on a CPU with AVX512-VNNI or AVX2")
    if args.threads:
        torch.set_num_threads(args.threads)
    built = build_layers(args.layers)
    results = []
    print(f"{args.layers} layers' linears, {torch.get_num_threads()} threads, median of {args.rounds} rounds; "
          f"the engine runs int8 up to {native_int8_max_rows()} rows")
    print(f"{'rows':>5} {'bf16 ms':>9} {'int8 ms':>9} {'int8 / bf16':>12}")
    for rows in (int(r) for r in args.rows.split(",")):
        bf16, int8 = time_rows(built, rows, args.rounds)
        b, q = statistics.median(bf16) * 1e3, statistics.median(int8) * 1e3
        results.append({"rows": rows, "bf16_ms": b, "int8_ms": q, "ratio": q / b,
                        "bf16_runs_ms": [t * 1e3 for t in bf16], "int8_runs_ms": [t * 1e3 for t in int8]})
        print(f"{rows:5d} {b:9.2f} {q:9.2f} {q / b:11.2f}x", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": torch.get_num_threads(), "layers": args.layers,
                               "int8_max_rows": native_int8_max_rows(), "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
