"""The native linear kernel against oneDNN's prepacked one, at each step size: where oneDNN should take over.

Every linear of SmolLM2-135M's 30 decoder layers (qkv 576 -> 960, o 576 -> 576, gate/up 576 -> 3072, down
1536 -> 576), then its LM head (576 -> 49,152), each on random bf16 weights of its own (270 MB, streamed from
memory as a step streams the model's), at each row count and thread count; best of three rounds, the kernels
timed turn about: the native kernel on its AVX512-BF16 dot products, on AMX tiles where it has them, and oneDNN.
Prints milliseconds per step, the layers' and the LM head's apart (a step computes the LM head only for the rows
it samples: a prompt's last token, not its every row), and for each the largest row count at which the native
kernel (on tiles where it has them) is still faster (EngineConfig.native_linear_max_rows;
engine.models.layers.AMX_TILES_MAX_ROWS is this on a Xeon with AMX, AMX_NATIVE_MAX_ROWS the dot products'). Writes
JSON: `ms` the two together, `layers_ms` and `lm_head_ms` each.

    python -m benchmarks.linear_crossover --threads 1,2 --rows 1,2,4,8,16,32,64,80,96,128,256
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.kernel_ab import LAYERS, LINEAR_SHAPES
from engine.kernels import cpu_has_amx, native_linear_amx, native_linear_available
from engine.models.layers import onednn_prepack_available

LM_HEAD = (49152, 576)


def best_of(fn, rounds: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def model_linears() -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(outputs, native packed weight, oneDNN's reordered weight) for each linear of one step, in order."""
    linears = []
    for (n, k) in [shape for _ in range(LAYERS) for shape in LINEAR_SHAPES] + [LM_HEAD]:
        weight = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
        linears.append((n, torch.ops.tokenline.pack_linear_weight(weight.contiguous()),
                        torch.ops.mkldnn._reorder_linear_weight(weight, None)))
    return linears


def step_ms(linears: list[tuple[int, torch.Tensor, torch.Tensor]], rows: int,
            kernels: list[str]) -> tuple[dict[str, float], dict[str, float]]:
    """Milliseconds for one step's linears at `rows` rows on each kernel: the decoder layers', and the LM head's
    (the last of `linears`) apart. A step computes the LM head only for the rows it samples (its decodes and each
    prompt's last token), so a prompt step's row count says where its layers' kernel should change, not its head's."""
    xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {packed.size(1) * 2 for _, packed, _ in linears}}
    outs = [torch.empty(rows, n, dtype=torch.bfloat16) for n, _, _ in linears]

    def native(part: slice):
        def run() -> None:
            for (n, packed, _), out in zip(linears[part], outs[part]):
                torch.ops.tokenline.packed_linear(out, xs[packed.size(1) * 2], packed, None, n)
        return run

    def onednn(part: slice):
        def run() -> None:
            for _, packed, reordered in linears[part]:
                torch.ops.mkldnn._linear_pointwise(xs[packed.size(1) * 2], reordered, None, "none", [], "")
        return run

    amx_rows = torch.ops.tokenline.linear_amx_min_rows()
    layers, head = {}, {}
    try:
        for kernel in kernels:
            if kernel != "oneDNN":
                torch.ops.tokenline.linear_amx_min_rows(1 if kernel == "AMX tiles" else 0)
            of = onednn if kernel == "oneDNN" else native
            layers[kernel] = best_of(of(slice(0, -1))) * 1e3
            head[kernel] = best_of(of(slice(-1, None))) * 1e3
    finally:
        torch.ops.tokenline.linear_amx_min_rows(amx_rows)
    return layers, head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    parser.add_argument("--out", default="results/linear_crossover.json")
    args = parser.parse_args()
    if not (native_linear_available() and onednn_prepack_available()):
        raise SystemExit("needs the native linear kernel (AVX512-BF16) and oneDNN's prepacked linear")
    rows_list = [int(r) for r in args.rows.split(",")]
    kernels = ["dot products"] + (["AMX tiles"] if native_linear_amx() else []) + ["oneDNN"]
    report = {"amx": cpu_has_amx(), "kernels": kernels, "runs": []}
    print(f"CPU with AMX: {report['amx']}; milliseconds for one step's linears, the 30 layers' and the LM head's: "
          + " / ".join(kernels))
    linears = model_linears()
    native_kernel = kernels[-2]  # on tiles where it has them
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        layers_win = head_win = None
        for rows in rows_list:
            layers, head = step_ms(linears, rows, kernels)
            report["runs"].append({"threads": threads, "rows": rows, "ms": {k: layers[k] + head[k] for k in kernels},
                                   "layers_ms": layers, "lm_head_ms": head})
            print(f"  {threads} threads, {rows:4d} rows: layers " + " / ".join(f"{layers[k]:7.2f}" for k in kernels)
                  + "   LM head " + " / ".join(f"{head[k]:7.2f}" for k in kernels), flush=True)
            if layers[native_kernel] <= layers["oneDNN"]:
                layers_win = rows
            if head[native_kernel] <= head["oneDNN"]:
                head_win = rows
        print(f"  {threads} threads: the native kernel ({native_kernel}) is faster up to {layers_win} rows for the "
              f"layers, {head_win} for the LM head, of those measured")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
