"""Two engine processes decoding at once, each on its own CPU, with one shared copy of the packed weights
(`engine.share_weights`) against a copy each: the layout `make serve` runs (one engine replica per CPU).

Each round starts two processes of one mode; both load the model, then for each batch size they fill the batch with
random prompts, decode, and time their steps over the same wall-clock window. Rounds alternate the modes. Prints the
median step time of each mode and batch size over rounds and processes, their ratio, and each process's
proportional share of resident memory (PSS: a shared page counts half to each of two), and writes JSON.

    python -m benchmarks.shared_weights --model ~/.cache/tokenline/SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("private", "shared")
LOAD_S = 90.0  # the slowest load (and huge-page collapse) a round waits for before its first window
MAX_TOKENS = 1000  # more than a window decodes: no stream ends inside one


def smaps_pss_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Pss:"))


def child(args: argparse.Namespace) -> None:
    """One engine process: waits for the round's windows and prints its step times as JSON."""
    import torch

    from benchmarks.bench_engine import random_prompts
    from engine import EngineConfig, LLMEngine, SamplingParams

    if args.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model=args.model, dtype="bfloat16", num_threads=1, max_num_batched_tokens=320,
                                    kv_cache_memory_bytes=640 << 20, share_weights=args.mode == "shared",
                                    shared_weights_dir=args.dir))
    engine.settle(timeout_s=60)
    prompts = iter(random_prompts(sum(args.batches), args.prompt_tokens, seed=args.cpu or 0))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    result = {"mode": args.mode, "pss_mib": smaps_pss_kib() >> 10, "step_ms": {}}
    for k, batch in enumerate(args.batches):
        ids = [f"{batch}-{i}" for i in range(batch)]
        for rid in ids:
            engine.add_request(rid, next(prompts), params)
        for _ in range(batch + 10):  # prefills, then a few decodes
            engine.step()
        window = args.start + k * (args.seconds + args.gap_s)
        time.sleep(max(0.0, window - time.time()))
        times = []
        while time.time() < window + args.seconds:
            start = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start) * 1000)
        if not times:
            raise SystemExit(f"batch {batch}: its prefills ran past its timed window on this machine; give them "
                             f"more time with --gap-s (now {args.gap_s:g})")
        result["step_ms"][str(batch)] = statistics.median(times)
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
    print(json.dumps(result), flush=True)
    engine.close()


def round_of(mode: str, args: argparse.Namespace, directory: str) -> list[dict]:
    start = time.time() + LOAD_S
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [None, None]
    procs = []
    for cpu in (cpus + cpus)[:2]:
        cmd = [sys.executable, "-m", "benchmarks.shared_weights", "--child", "--mode", mode, "--model", args.model,
               "--start", str(start), "--seconds", str(args.seconds), "--gap-s", str(args.gap_s),
               "--prompt-tokens", str(args.prompt_tokens), "--dir", directory,
               "--batches", *map(str, args.batches)] + (["--cpu", str(cpu)] if cpu is not None else [])
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=LOAD_S + len(args.batches) * (args.seconds + args.gap_s) + 300)
            if proc.returncode != 0:
                raise RuntimeError(f"an engine process of the {mode} round failed ({proc.returncode})")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.expanduser("~/.cache/tokenline/SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each mode, alternating")
    parser.add_argument("--seconds", type=float, default=5.0, help="each batch size's timed window")
    parser.add_argument("--gap-s", type=float, default=8.0, help="between windows: the next batch's prefills")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--out", default="results/shared_weights.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--start", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    directory = tempfile.mkdtemp(prefix="tokenline-shared-weights-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                 else None)
    rounds: dict[str, list[dict]] = {m: [] for m in MODES}
    try:
        for r in range(args.rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                results = round_of(mode, args, directory)
                rounds[mode] += results
                print(f"round {r + 1} {mode}: " + ", ".join(
                    f"batch {b} " + "/".join(f"{x['step_ms'][str(b)]:.2f}" for x in results) + " ms"
                    for b in args.batches) + f"; PSS {'/'.join(str(x['pss_mib']) for x in results)} MiB",
                    flush=True)
    finally:
        for path in Path(directory).iterdir():
            path.unlink()
        os.rmdir(directory)
    summary = {}
    print(f"\n{'batch':>5} {'private ms':>11} {'shared ms':>10} {'ratio':>6}")
    for b in args.batches:
        p, s = (statistics.median(x["step_ms"][str(b)] for x in rounds[m]) for m in MODES)
        summary[str(b)] = {"private_ms": p, "shared_ms": s, "ratio": s / p}
        print(f"{b:>5} {p:>11.2f} {s:>10.2f} {s / p:>6.2f}")
    pss = {m: statistics.median(x["pss_mib"] for x in rounds[m]) for m in MODES}
    print(f"PSS per engine process: private {pss['private']:.0f} MiB, shared {pss['shared']:.0f} MiB")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "pss_mib": pss, "rounds": rounds,
                                          "args": {k: v for k, v in vars(args).items() if k != "child"}}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
