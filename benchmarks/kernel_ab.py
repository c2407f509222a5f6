"""Two versions of one CPU kernel file, built side by side in one process and timed alternately.

The engine's steps move with the machine by more than a kernel change does; building the file at two git
revisions (or one and the working tree) as two libraries, each under its own op namespace, and timing them in
turn on the same tensors, best of a few rounds, shows the change itself.

    python -m benchmarks.kernel_ab linear --base 5c3b66a --head 7b2d2f8 --threads 1,2 --rows 1,16,32,64,256
    python -m benchmarks.kernel_ab attention --base 5c3b66a --head a23d7d6 --threads 1,2 --batches 32x300,8x1000
    python -m benchmarks.kernel_ab attention --base eae741d --batches none --prompts 256,2048,320+1728

`linear`: every linear of SmolLM2-135M's 30 decoder layers on random bf16 weights (qkv 576 -> 960, o 576 -> 576,
gate/up 576 -> 3072, down 1536 -> 576), then its LM head (576 -> 49,152, fp32 out), at each row count; then the 30
gate/ups again as the MLP calls them, with SiLU-and-mul (`packed_linear_silu_mul`: fused on AMX tiles from 17 rows,
below that the linear and then the main build's `silu_and_mul`, which this comparison does not vary).
`attention`: 30 layers of decode attention (9 query heads, 3 KV heads, head_dim 64, blocks of 16 tokens; keys packed
where the CPU has AVX512-BF16, else in the plain layout)
over BATCHxCONTEXT rows whose blocks lie scattered through a pool of 1,024 blocks per layer; with `--prompts`,
30 layers of a prompt chunk's attention (ROWS, or ROWS+CACHED after that many cached tokens: each row causal up to
its own position), the same pool.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from engine.kernels import CFLAGS, HEADERS, cpu_kernels_available, packed_keys_supported

ROOT = Path(__file__).resolve().parents[1]
FILES = {"linear": "engine/kernels/linear_cpu.cpp", "attention": "engine/kernels/paged_attention_cpu.cpp"}
LINEAR_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of SmolLM2-135M's linears
LAYERS = 30


def source_at(path: str, revision: str | None) -> str:
    """The file at a git revision, or in the working tree (None)."""
    if revision is None:
        return (ROOT / path).read_text()
    return subprocess.run(["git", "show", f"{revision}:{path}"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def build(kernel: str, revision: str | None, name: str, workdir: Path):
    """Builds the kernel file with its ops registered under `name` instead of `tokenline`; returns that namespace."""
    from torch.utils.cpp_extension import load

    text = source_at(FILES[kernel], revision)
    text = re.sub(r"TORCH_LIBRARY(_FRAGMENT)?\(tokenline,", rf"TORCH_LIBRARY\1({name},", text)
    source = workdir / f"{name}.cpp"
    source.write_text(text)
    for header in HEADERS:  # the headers it includes, at the same revision (older ones had none)
        try:
            (workdir / header).write_text(source_at(f"engine/kernels/{header}", revision))
        except (subprocess.CalledProcessError, FileNotFoundError):
            pass
    load(name=name, sources=[str(source)], is_python_module=False, extra_cflags=list(CFLAGS),
         extra_ldflags=["-fopenmp"], build_directory=str(workdir), verbose=False)
    return getattr(torch.ops, name)


def time_linear(ops, rows: int, rounds: int) -> tuple[float, float, float]:
    """Seconds (best of `rounds`) for the 30 layers' linears, for their gate/up with SiLU-and-mul (the MLP's fused
    call; nan where the version has none), and for the LM head, at `rows` rows."""
    torch.manual_seed(0)
    layers = [[ops.pack_linear_weight(torch.randn(n, k, dtype=torch.bfloat16) * 0.05) for n, k in LINEAR_SHAPES]
              for _ in range(LAYERS)]
    head = ops.pack_linear_weight(torch.randn(49152, 576, dtype=torch.bfloat16) * 0.05)
    xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (576, 1536)}
    outs = {n: torch.empty(rows, n, dtype=torch.bfloat16) for n, _ in LINEAR_SHAPES}
    logits = torch.empty(rows, 49152, dtype=torch.float32)
    gate_up = LINEAR_SHAPES.index((3072, 576))
    act = torch.empty(rows, 1536, dtype=torch.bfloat16)
    try:
        fused = ops.packed_linear_silu_mul  # below 17 rows it calls tokenline::silu_and_mul: the main build's
    except AttributeError:  # a revision from before it
        fused = None
    best_layers = best_silu = best_head = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for weights in layers:
            for (n, k), w in zip(LINEAR_SHAPES, weights):
                ops.packed_linear(outs[n], xs[k], w, None, n)
        middle = time.perf_counter()
        ops.packed_linear(logits, xs[576], head, None, 49152)
        best_layers, best_head = min(best_layers, middle - start), min(best_head, time.perf_counter() - middle)
        if fused is not None:
            start = time.perf_counter()
            for weights in layers:
                fused(act, xs[576], weights[gate_up], None, 3072)
            best_silu = min(best_silu, time.perf_counter() - start)
    return best_layers, best_silu if fused is not None else float("nan"), best_head


def time_attention(ops, batch: int, context: int, rounds: int, prompt: bool = False) -> float:
    """Seconds (best of `rounds`) for 30 layers of decode attention over batch x context tokens; with `prompt`, of
    one sequence's chunk of `batch` rows after `context` cached tokens."""
    torch.manual_seed(0)
    pool, heads, kv_heads, dim, block = 1024, 9, 3, 64, 16
    blocks = -(-(context + batch) // block) if prompt else -(-context // block)
    if (1 if prompt else batch) * blocks > pool:
        raise SystemExit(f"{batch}x{context} needs more blocks a layer than the pool's {pool}")
    # Keys packed in pairs where this CPU's kernel reads them so (AVX512-BF16), else in the plain layout, like V.
    key_shape = (pool, kv_heads, dim // 2, block, 2) if packed_keys_supported(block, dim, heads // kv_heads) \
        else (pool, kv_heads, block, dim)
    caches = [(torch.randn(key_shape).to(torch.bfloat16),
               torch.randn(pool, kv_heads, block, dim).to(torch.bfloat16)) for _ in range(LAYERS)]
    if prompt:  # every row reads the sequence's blocks, causal up to its own position
        tables = [torch.randperm(pool)[:blocks].expand(batch, blocks).contiguous() for _ in range(LAYERS)]
        lens = torch.arange(context + 1, context + batch + 1)
    else:
        tables = [torch.randperm(pool)[:batch * blocks].view(batch, blocks).contiguous() for _ in range(LAYERS)]
        lens = torch.full((batch,), context, dtype=torch.long)
    q = torch.randn(batch, heads, dim).to(torch.bfloat16)
    out = torch.empty(batch, heads * dim, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for (k, v), table in zip(caches, tables):
            ops.paged_decode_attention(out, q, k, v, table, lens, dim ** -0.5)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel", choices=sorted(FILES))
    parser.add_argument("--base", required=True, help="git revision of the version to compare against")
    parser.add_argument("--head", default=None, help="git revision of the new version (default: the working tree)")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rows", default="1,16,32,64,256", help="linear: rows of x")
    parser.add_argument("--batches", default="32x300,16x300,8x1000",
                        help="attention: BATCHxCONTEXT decodes, comma-separated (none: skip)")
    parser.add_argument("--prompts", default="", help="attention: ROWS or ROWS+CACHED prompt chunks, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds; each reports its best of 5")
    args = parser.parse_args()

    if args.kernel == "linear" and not cpu_kernels_available():  # the ops the file reaches by name: the main build's
        raise SystemExit("the native CPU kernels did not build here")
    with tempfile.TemporaryDirectory(prefix="kernel_ab_") as tmp:
        versions = {"base": build(args.kernel, args.base, "kernel_ab_base", Path(tmp)),
                    "head": build(args.kernel, args.head, "kernel_ab_head", Path(tmp))}
        print(f"{args.kernel}: base {args.base}, head {args.head or 'working tree'}; ms, best of {args.repeats} "
              f"alternating rounds")
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            if args.kernel == "linear":
                for rows in (int(r) for r in args.rows.split(",")):
                    got = _alternate(versions, args.repeats, lambda ops: time_linear(ops, rows, 5))
                    cells = (f"{name}: layers {min(r[0] for r in runs) * 1e3:7.2f}, "
                             f"gate/up + SiLU {min(r[1] for r in runs) * 1e3:6.2f}, "
                             f"LM head {min(r[2] for r in runs) * 1e3:6.2f}" for name, runs in got.items())
                    print(f"threads {threads} rows {rows:4d}: " + "   ".join(cells), flush=True)
            else:
                for spec in (b for b in args.batches.split(",") if b and b != "none"):
                    batch, context = (int(v) for v in spec.split("x"))
                    got = _alternate(versions, args.repeats, lambda ops: time_attention(ops, batch, context, 5))
                    print(f"threads {threads} batch {batch} x {context} tokens: " + "   ".join(
                        f"{name}: {min(runs) * 1e3:7.2f}" for name, runs in got.items()), flush=True)
                for spec in (p for p in args.prompts.split(",") if p):
                    rows, _, cached = spec.partition("+")
                    rows, cached = int(rows), int(cached or 0)
                    got = _alternate(versions, args.repeats,
                                     lambda ops: time_attention(ops, rows, cached, 5, prompt=True))
                    print(f"threads {threads} prompt chunk of {rows} after {cached} cached: " + "   ".join(
                        f"{name}: {min(runs) * 1e3:7.2f}" for name, runs in got.items()), flush=True)


def _alternate(versions: dict, repeats: int, measure) -> dict[str, list]:
    """Each version measured in turn, `repeats` rounds."""
    got: dict[str, list] = {name: [] for name in versions}
    for _ in range(repeats):
        for name, ops in versions.items():
            got[name].append(measure(ops))
    return got


if __name__ == "__main__":
    main()
