"""The engine on transparent huge pages against the same engine on 4 KiB pages (`engine.huge_pages`), side by side.

Two engines in one process, the same model and configuration but for `huge_pages`, measured in turn so that both
see the same moments of a noisy machine (rounds alternate which goes first): a lone prompt's prefill on one, then
on the other (4 times each), then the same batch of 1 and of 32 decoding on both, one step of each in turn
(the median of each batch's last steps). Prints the medians over rounds and their ratio, and writes JSON.

    python -m benchmarks.huge_pages --model ~/.cache/tokenline/SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.bench_engine import random_prompts
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import default_num_threads

MEASURES = ("prefill_ms", "decode_b1_ms", "decode_b32_ms")


def prefill_ms(engines: list[LLMEngine], prompts, repeats: int = 4) -> list[float]:
    """A lone prompt's prefill on each engine in turn, `repeats` times; the median of each engine's times."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times: list[list[float]] = [[] for _ in engines]
    for i in range(repeats):
        for k, engine in enumerate(engines):
            prompt = next(prompts)
            start = time.perf_counter()
            engine.generate([prompt], params)
            times[k].append((time.perf_counter() - start) * 1000)
    return [statistics.median(t) for t in times]


def decode_ms(engines: list[LLMEngine], prompts, batch: int, output_tokens: int, tag: str) -> list[float]:
    """The same batch on each engine, stepped in turn (one step of each, then the next), so that both see the
    same moments of a noisy machine; the median step of each once every prompt is in (all steps decodes)."""
    params = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    batch_prompts = [next(prompts) for _ in range(batch)]
    times: list[list[float]] = [[] for _ in engines]
    for k, engine in enumerate(engines):
        for i, prompt in enumerate(batch_prompts):
            engine.add_request(f"{tag}-d{batch}-{i}", prompt, params)
    for _ in range(10 * output_tokens + batch):
        if not any(e.has_unfinished() for e in engines):
            break
        for k, engine in enumerate(engines):
            if engine.has_unfinished():
                start = time.perf_counter()
                engine.step()
                times[k].append((time.perf_counter() - start) * 1000)
    return [statistics.median(t[-output_tokens // 2:]) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: this process's CPUs)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--out", default="results/huge_pages.json")
    args = parser.parse_args()
    threads = args.threads or default_num_threads()
    torch.set_num_threads(threads)
    engines = {}
    for huge in (True, False):
        engines[huge] = LLMEngine(EngineConfig(model=args.model, dtype="bfloat16", max_num_batched_tokens=320,
                                               num_threads=threads, kv_cache_memory_bytes=args.kv_cache_mib << 20,
                                               huge_pages=huge))
    engines[True].settle()
    job = engines[True].runner.huge_pages
    report = job.report
    print(f"huge pages: {report.collapsed} of {report.frames} frames of {report.frame_bytes >> 20} MiB in "
          f"{job.seconds:.2f} s{f' ({report.reason})' if report.reason else ''}", flush=True)
    prompts = iter(random_prompts(args.rounds * 41 + 8, args.prompt_tokens, 1))
    results: dict[bool, dict[str, list[float]]] = {h: {m: [] for m in MEASURES} for h in engines}
    for r in range(args.rounds):
        order = [True, False] if r % 2 == 0 else [False, True]
        pair, tag = [engines[h] for h in order], f"r{r}"
        measured = {"prefill_ms": prefill_ms(pair, prompts),
                    "decode_b1_ms": decode_ms(pair, prompts, 1, args.output_tokens, tag),
                    "decode_b32_ms": decode_ms(pair, prompts, 32, args.output_tokens, tag)}
        for m, values in measured.items():
            for huge, value in zip(order, values):
                results[huge][m].append(value)
        print(f"round {r}: " + "; ".join(f"{m} {results[True][m][-1]:.2f} / {results[False][m][-1]:.2f}"
                                         for m in MEASURES) + " (huge / plain)", flush=True)
    summary = {}
    for m in MEASURES:
        huge, plain = statistics.median(results[True][m]), statistics.median(results[False][m])
        summary[m] = {"huge_pages": huge, "plain": plain, "ratio": huge / plain}
        print(f"{m}: huge pages {huge:.2f}, 4 KiB pages {plain:.2f}, ratio {huge / plain:.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": threads, "prompt_tokens": args.prompt_tokens,
                               "frames": report.frames, "collapsed": report.collapsed,
                               "collapse_s": job.seconds, "summary": summary,
                               "rounds": {str(h): v for h, v in results.items()}}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
