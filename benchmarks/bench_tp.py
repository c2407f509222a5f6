"""Per-step cost of tensor parallelism on CPU: engine step times with one rank and with two (local processes),
over the same CPUs, at decode batch 1 and 16 and for a prefill step of 256 tokens.

Variants, measured round after round, interleaved (the machine's noise hits each alike):
- tp1: one rank with all `--threads` torch threads (the engine as it runs without tensor parallelism);
- tp1-half: one rank with half the threads (what each of the two ranks gets);
- tp2-shm / tp2-gloo: two ranks of half the threads each; all-reduces through shared memory or gloo.
tp2 minus tp1-half is what the second rank costs a step (the step's broadcast and the collectives).

    python -m benchmarks.bench_tp --model ~/.cache/tokenline/SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from benchmarks.bench_engine import random_prompts
from engine import EngineConfig, LLMEngine, SamplingParams

log = logging.getLogger("bench_tp")


def variants(threads: int) -> dict[str, dict]:
    half = max(1, threads // 2)
    return {"tp1": dict(tensor_parallel_size=1, num_threads=threads),
            "tp1-half": dict(tensor_parallel_size=1, num_threads=half),
            "tp2-shm": dict(tensor_parallel_size=2, num_threads=half, shm_collectives=True),
            "tp2-gloo": dict(tensor_parallel_size=2, num_threads=half, shm_collectives=False)}


def decode_step_ms(engine: LLMEngine, batch: int, steps: int, seed: int) -> float:
    """Median ms of a decode step of `batch` requests (their 64-token prompts prefilled first)."""
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, 64, seed)):
        engine.add_request(f"d{seed}-{i}", prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for request_id in list(engine.requests):
        engine.abort(request_id)
    engine.step()
    return 1000 * statistics.median(times)


def prefill_step_ms(engine: LLMEngine, tokens: int, repeats: int, seed: int) -> float:
    """Median ms of a step that prefills one `tokens`-token prompt."""
    times = []
    for i, prompt in enumerate(random_prompts(repeats, tokens, seed)):
        engine.add_request(f"p{seed}-{i}", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        while engine.has_unfinished():
            engine.step()
    return 1000 * statistics.median(times)


def measure(model: str, dtype: str, options: dict, steps: int, seed: int) -> dict[str, float]:
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, num_kv_blocks=512, max_num_batched_tokens=512,
                                    enable_prefix_caching=False, **options))
    try:
        engine.settle()
        decode_step_ms(engine, 1, 3, seed)  # warm-up
        return {"decode_b1_ms": decode_step_ms(engine, 1, steps, seed),
                "decode_b16_ms": decode_step_ms(engine, 16, steps, seed + 1),
                "prefill_256_ms": prefill_step_ms(engine, 256, 5, seed + 2)}
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2, help="CPUs every variant spreads over")
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed per batch size")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default="tp1,tp1-half,tp2-shm,tp2-gloo")
    parser.add_argument("--out", default="results/bench_tp.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    chosen = {name: options for name, options in variants(args.threads).items() if name in args.variants.split(",")}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in chosen}
    for round_ in range(args.rounds):
        for name, options in chosen.items():
            runs[name].append(measure(args.model, args.dtype, options, args.steps, seed=round_))
            print(f"round {round_ + 1}: {name:9s} " + "  ".join(f"{k} {v:7.2f}" for k, v in runs[name][-1].items()),
                  flush=True)
    summary = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    print(f"\nmedian over {args.rounds} rounds, {args.threads} threads in all ({args.dtype}, {Path(args.model).name}):")
    for name, values in summary.items():
        print(f"  {name:9s} " + "  ".join(f"{k} {v:7.2f}" for k, v in values.items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "threads": args.threads,
                               "torch": torch.__version__, "variants": {n: chosen[n] for n in chosen},
                               "median": summary, "rounds": runs}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
