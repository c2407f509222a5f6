"""The native linear kernel against oneDNN's prepacked one, at each step size: where oneDNN should take over.

Every linear of SmolLM2-135M's 30 decoder layers on random bf16 weights (qkv 576 -> 960, o 576 -> 576, gate/up
576 -> 3072, down 1536 -> 576), then its LM head (576 -> 49,152), at each row count and thread count; best of
three rounds, the two kernels timed turn about. Prints milliseconds per step and the largest row count at which
the native kernel is still faster (EngineConfig.native_linear_max_rows; engine.models.layers.AMX_NATIVE_MAX_ROWS
is this on a Xeon with AMX). Writes JSON.

    python -m benchmarks.linear_crossover --threads 1,2 --rows 1,2,4,8,16,32,64,256
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.kernel_ab import LAYERS, LINEAR_SHAPES
from engine.kernels import cpu_has_amx, native_linear_available
from engine.models.layers import onednn_prepack_available

LM_HEAD = (49152, 576)


def best_of(fn, rounds: int = 3, calls: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def step_ms(rows: int) -> tuple[float, float]:
    """(native, oneDNN) milliseconds for one step's linears at `rows` rows."""
    native = onednn = 0.0
    for (n, k), count in [(shape, LAYERS) for shape in LINEAR_SHAPES] + [(LM_HEAD, 1)]:
        weight = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        packed = torch.ops.tokenline.pack_linear_weight(weight.contiguous())
        reordered = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        out = torch.empty(rows, n, dtype=torch.bfloat16)
        native += count * best_of(lambda: torch.ops.tokenline.packed_linear(out, x, packed, None, n))
        onednn += count * best_of(lambda: torch.ops.mkldnn._linear_pointwise(x, reordered, None, "none", [], ""))
    return native * 1e3, onednn * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    parser.add_argument("--out", default="results/linear_crossover.json")
    args = parser.parse_args()
    if not (native_linear_available() and onednn_prepack_available()):
        raise SystemExit("needs the native linear kernel (AVX512-BF16) and oneDNN's prepacked linear")
    rows_list = [int(r) for r in args.rows.split(",")]
    report = {"amx": cpu_has_amx(), "runs": []}
    print(f"CPU with AMX: {report['amx']}; milliseconds for one step's linears (30 layers + LM head)")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        rows_native_wins = None
        for rows in rows_list:
            native, onednn = step_ms(rows)
            report["runs"].append({"threads": threads, "rows": rows, "native_ms": native, "onednn_ms": onednn})
            print(f"  {threads} threads, {rows:4d} rows: native {native:8.2f}, oneDNN {onednn:8.2f} "
                  f"(oneDNN's time {onednn / native:.2f}x the native kernel's)", flush=True)
            if native <= onednn:
                rows_native_wins = rows
        print(f"  {threads} threads: the native kernel is faster up to {rows_native_wins} rows of those measured")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
