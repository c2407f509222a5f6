"""Offline engine benchmark: our engine against transformers' `generate` on the same prompts, in one run.

Random 256-token prompts, 128 output tokens (ignore_eos), concurrency 1, 8 and 32. Prints a table and
writes JSON. Also measures this machine's matmul GFLOP/s so the numbers can be read against the roofline.

Then `make bench-peers`' workload in process, with the engine as `make serve` runs it (`--serve-config`, by default
serve_config.yaml: its step budgets and its replica's CPUs as threads): 4 x concurrency requests, at most
`concurrency` of them in flight, each finished one replaced at once, as `vllm bench serve --max-concurrency` sends
them, with no HTTP, no ingress and no Ray around the engine. The served figures of `make bench-peers` over these
are what the serving path keeps of its engine on the same workload; the table above runs each level as one batch
of prompts on the engine's defaults (2,048 tokens a step), a shape no client sends.

    python -m benchmarks.bench_engine --model ~/.cache/tokenline/SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import ModelArgs, default_num_threads, resolve_dtype
from benchmarks.plot import plot_bars
from benchmarks.step_figures import step_figures
from benchmarks.step_profile import SERVE_CONFIG, serve_app_args
from loadtests.metrics import percentile
from deployments.config import AppArgs
from engine.loader import load_model_source

log = logging.getLogger("bench_engine")

# Steps the in-process workload's engine keeps: every step of a level (128 requests of 128 tokens at 32 streams is
# about 600), so its full-batch decode step is read from all of them.
WORKLOAD_STEP_HISTORY = 8192


@dataclass
class EngineRun:
    dtype: str
    concurrency: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    prefill_tok_s: float
    decode_ms_per_step_p50: float
    decode_only_tok_s: float
    steps: int
    step_samples: list[tuple[int, int, float]]  # (prefill tokens, decode tokens, seconds): a step-time model's data


@dataclass
class WorkloadRun:
    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    ttft_p50_ms: float
    itl_p99_ms: float
    steps: int
    ttft_p99_ms: float = 0.0
    tpot_p50_ms: float = 0.0  # each request's (last token - first token) / (tokens - 1), as vllm bench serve's TPOT
    itl_p50_ms: float = 0.0
    # The engine's decode steps that carried every stream (benchmarks/step_figures.py): how many, their median
    # duration, and the steps' share of the run's time.
    full_batch_steps: int = 0
    decode_step_ms: float | None = None
    busy_share: float | None = None
    cpu_s: float = 0.0  # this process's CPU time over the run, every thread's


@dataclass
class HFRun:
    dtype: str
    batch: int
    wall_s: float
    output_tok_s: float


def matmul_gflops(dtype: torch.dtype, n: int = 1024, repeats: int = 10) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def flops_per_token(args: ModelArgs, context: float) -> float:
    """Matmul FLOPs for one token: every linear layer plus the LM head, plus attention over `context` tokens."""
    h, kv = args.hidden_size, args.num_kv_heads * args.head_dim
    q = args.num_heads * args.head_dim
    linear = h * (q + 2 * kv) + q * h + 3 * h * args.intermediate_size
    attention = 4 * q * context
    return 2 * (args.num_layers * linear + h * args.vocab_size) + args.num_layers * attention


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(300, 40000, (length,), generator=gen).tolist() for _ in range(n)]


def run_engine(engine: LLMEngine, prompts: list[list[int]], output_len: int, dtype: str,
               temperature: float = 0.0) -> EngineRun:
    engine.kv.reset_prefix_cache()
    params = SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True)
    first_step = engine.stats().num_steps
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    steps = [s for s in engine.step_history if s.step > first_step]
    decode = sorted(s.duration_s for s in steps if s.num_prefill_tokens == 0)
    prefill_steps = [s for s in steps if s.num_decode_tokens == 0 and s.num_prefill_tokens]
    prefill_time = sum(s.duration_s for s in prefill_steps)
    decode_p50 = statistics.median(decode) if decode else float("nan")
    produced = sum(len(o) for o in outputs)
    return EngineRun(dtype, len(prompts), produced, wall, produced / wall,
                     sum(s.num_prefill_tokens for s in prefill_steps) / prefill_time if prefill_time else 0.0,
                     decode_p50 * 1000, len(prompts) / decode_p50, len(steps),
                     [(s.num_prefill_tokens, s.num_decode_tokens, round(s.duration_s, 6)) for s in steps])


def run_served_workload(engine: LLMEngine, prompts: list[list[int]], concurrency: int, output_len: int,
                        temperature: float = 0.0, tag: str = "w") -> WorkloadRun:
    """Every prompt as a request, at most `concurrency` in flight; each one that finishes is replaced by the next at
    once (a closed loop, as a benchmark client with a concurrency limit drives a server)."""
    engine.kv.reset_prefix_cache()
    params = SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True)
    first_step = engine.stats().num_steps
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    ttfts: list[float] = []
    gaps: list[float] = []
    produced = 0

    def add(i: int) -> None:
        rid = f"{tag}{concurrency}-{i}"
        added[rid] = time.perf_counter()
        engine.add_request(rid, prompts[i], params)

    start, cpu_start = time.perf_counter(), time.process_time()
    nxt = min(concurrency, len(prompts))
    for i in range(nxt):
        add(i)
    in_flight = nxt
    while in_flight:
        outputs = engine.step()
        now = time.perf_counter()
        for o in outputs:
            if o.new_token_ids:
                produced += len(o.new_token_ids)
                if o.request_id in last:
                    gaps.append(now - last[o.request_id])
                else:
                    ttfts.append(now - added[o.request_id])
                    first[o.request_id] = now
                last[o.request_id] = now
                counts[o.request_id] = counts.get(o.request_id, 0) + len(o.new_token_ids)
            if o.finished:
                in_flight -= 1
                if nxt < len(prompts):
                    add(nxt)
                    nxt += 1
                    in_flight += 1
    wall, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    steps = engine.stats().num_steps - first_step
    tpots = [(last[r] - first[r]) / (n - 1) for r, n in counts.items() if n > 1]
    figures = step_figures([(s.time, s.duration_s, s.num_prefill_tokens, s.num_decode_requests)
                            for s in engine.step_history if s.step > first_step], concurrency)
    return WorkloadRun(concurrency, len(prompts), produced, wall, produced / wall, percentile(ttfts, 0.5) * 1000,
                       percentile(gaps, 0.99) * 1000, steps, ttft_p99_ms=percentile(ttfts, 0.99) * 1000,
                       tpot_p50_ms=percentile(tpots, 0.5) * 1000 if tpots else 0.0,
                       itl_p50_ms=percentile(gaps, 0.5) * 1000, **asdict(figures), cpu_s=cpu_s)


def served_engine_config(serve_config: Path, model: str, max_concurrency: int) -> EngineConfig:
    """The engine of the first application in a Serve config file as `make serve` builds it, on `model`, with room
    for `max_concurrency` requests at once and the steps of a whole workload level in its step history."""
    config = AppArgs(**serve_app_args(serve_config)).engine_config()
    return dataclasses.replace(config, model=model, max_num_seqs=max(config.max_num_seqs, max_concurrency),
                               step_history=max(config.step_history, WORKLOAD_STEP_HISTORY))


def run_hf(model_path: Path, prompts: list[list[int]], output_len: int, dtype: torch.dtype,
           batches: list[int]) -> list[HFRun]:
    from transformers import LlamaConfig, LlamaForCausalLM

    args, weights = load_model_source(model_path)
    config = LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                         intermediate_size=args.intermediate_size, num_hidden_layers=args.num_layers,
                         num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
                         head_dim=args.head_dim, rms_norm_eps=args.rms_norm_eps,
                         max_position_embeddings=args.max_position_embeddings,
                         tie_word_embeddings=args.tie_word_embeddings,
                         rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta})
    model = LlamaForCausalLM(config)
    model.load_state_dict(weights, strict=False)
    model = model.to(dtype).eval()
    runs = []
    for batch in batches:
        ids = torch.tensor(prompts[:batch])
        with torch.inference_mode():
            model.generate(ids[:, :16], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=0)
            wall = time.perf_counter() - start
        produced = (out.shape[1] - ids.shape[1]) * batch
        runs.append(HFRun(str(dtype).removeprefix("torch."), batch, wall, produced / wall))
    return runs


def print_workload(workload: list[WorkloadRun], args: argparse.Namespace, served_config: EngineConfig | None) -> None:
    if not workload:
        return
    print(f"\nmake bench-peers' workload in process: {args.requests_per_concurrency} x concurrency requests (at least "
          f"{args.min_requests}), at most concurrency in flight, on the engine as {Path(args.serve_config).name} "
          f"runs it ({served_config.max_num_batched_tokens} tokens a step, beside decodes "
          f"{served_config.max_tokens_with_decodes or served_config.max_num_batched_tokens}, "
          f"{served_config.num_threads} threads)")
    print(f"{'conc':>4} {'requests':>8} {'out tok/s':>10} {'TTFT p50':>9} {'TPOT p50':>9} {'ITL p99':>8} {'steps':>6} "
          f"{'full-batch decode step':>22} {'busy':>5}")
    for w in workload:
        step = f"{w.decode_step_ms:.2f}ms ({w.full_batch_steps})" if w.decode_step_ms is not None else "-"
        busy = f"{w.busy_share:.0%}" if w.busy_share is not None else "-"
        print(f"{w.concurrency:4d} {w.requests:8d} {w.output_tok_s:10.1f} {w.ttft_p50_ms:7.1f}ms "
              f"{w.tpot_p50_ms:7.1f}ms {w.itl_p99_ms:6.1f}ms {w.steps:6d} {step:>22} {busy:>5}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--compare-dtype", default="float32", help="also time the engine in this dtype ('' to skip)")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batches", default="1,32", help="transformers generate batch sizes ('' to skip)")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (as vllm bench serve); 1: sampled, OpenAI's default")
    parser.add_argument("--serve-config", default=str(SERVE_CONFIG),
                        help="then bench-peers' workload on the engine as this Serve config runs it ('' to skip)")
    parser.add_argument("--requests-per-concurrency", type=int, default=4,
                        help="requests of that workload per concurrency level, times the level (bench-peers': 4)")
    parser.add_argument("--min-requests", type=int, default=8,
                        help="and at least this many per level (bench-peers': 8)")
    parser.add_argument("--workload-only", action="store_true",
                        help="only bench-peers' workload (how `make bench-peers` runs the in-process engine beside "
                             "the servers): no batch table, no transformers, no matmul roofline")
    parser.add_argument("--out", default="results/bench_engine.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    prompts = random_prompts(max(concurrencies), args.input_len, seed=0)
    source = load_model_source(args.model)
    model_args = source[0]

    runs: list[EngineRun] = []
    backend = None
    for dtype in [] if args.workload_only else [args.dtype] + ([args.compare_dtype] if args.compare_dtype else []):
        engine = LLMEngine(EngineConfig(model=args.model, dtype=dtype, max_num_seqs=max(concurrencies),
                                        attention_backend=args.attention_backend), source=source)
        backend = backend or engine.runner.attention_backend
        engine.settle()  # its memory on huge pages before anything is timed
        run_engine(engine, prompts[:2], 8, dtype)  # warm-up: kernels, allocator
        for c in concurrencies if dtype == args.dtype else [1, max(concurrencies)]:
            runs.append(run_engine(engine, prompts[:c], args.output_len, dtype, args.temperature))
            log.info("engine %s c=%d: %.1f tok/s", dtype, c, runs[-1].output_tok_s)
        del engine

    workload: list[WorkloadRun] = []
    served_config = None
    if args.serve_config:
        served_config = served_engine_config(Path(args.serve_config), args.model, max(concurrencies))
        engine = LLMEngine(served_config, source=source)
        engine.settle()
        run_served_workload(engine, prompts[:2], 2, 8, tag="warm")
        for c in concurrencies:
            level_prompts = random_prompts(max(args.min_requests, args.requests_per_concurrency * c), args.input_len,
                                           seed=1000 + c)
            workload.append(run_served_workload(engine, level_prompts, c, args.output_len, args.temperature))
            log.info("served workload c=%d: %.1f tok/s", c, workload[-1].output_tok_s)
        del engine

    served_workload = {"serve_config": args.serve_config or None,
                       "requests_per_concurrency": args.requests_per_concurrency, "min_requests": args.min_requests,
                       "runs": [asdict(w) for w in workload]}
    if args.workload_only:
        print_workload(workload, args, served_config)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "model": args.model, "input_len": args.input_len, "output_len": args.output_len,
            "temperature": args.temperature, "torch": torch.__version__, "served_workload": served_workload,
        }, indent=2))
        print(f"wrote {out}")
        return

    hf_batches = [int(b) for b in args.hf_batches.split(",")] if args.hf_batches else []
    hf_runs = run_hf(Path(args.model), prompts, args.output_len, resolve_dtype(args.dtype), hf_batches)
    gflops = {"bfloat16": matmul_gflops(torch.bfloat16), "float32": matmul_gflops(torch.float32)}

    avg_context = args.input_len + args.output_len / 2
    per_output = (flops_per_token(model_args, avg_context) * (args.input_len + args.output_len)
                  / args.output_len)
    per_decode = flops_per_token(model_args, avg_context)
    # The faster of the two: on CPUs without bf16 arithmetic (AVX2) torch's bf16 matmul is a fallback (~1-16 GFLOP/s)
    # and the native kernels widen bf16 weights to fp32, so fp32's rate is the machine's.
    peak = max(gflops.values()) * 1e9
    roofline = {"output_tok_s": peak / per_output, "decode_only_tok_s": peak / per_decode}

    print(f"\nmachine: {platform.processor() or platform.machine()}, {default_num_threads()} threads, "
          f"torch {torch.__version__}, attention backend: {backend}")
    print(f"matmul GFLOP/s: bf16 {gflops['bfloat16']:.0f}, fp32 {gflops['float32']:.0f}; "
          f"roofline {roofline['output_tok_s']:.0f} output tok/s, {roofline['decode_only_tok_s']:.0f} decode-only")
    print(f"{'dtype':9} {'conc':>4} {'out tok/s':>10} {'prefill tok/s':>13} {'decode ms/step':>14} "
          f"{'decode tok/s':>12} {'vs HF':>6} {'roofline':>8}")
    hf_by_batch = {r.batch: r for r in hf_runs}
    for r in runs:
        hf = hf_by_batch.get(r.concurrency) if r.dtype == args.dtype else None
        ratio = f"{r.output_tok_s / hf.output_tok_s:.2f}x" if hf else "-"
        print(f"{r.dtype:9} {r.concurrency:4d} {r.output_tok_s:10.1f} {r.prefill_tok_s:13.0f} "
              f"{r.decode_ms_per_step_p50:14.1f} {r.decode_only_tok_s:12.1f} {ratio:>6} "
              f"{r.output_tok_s / roofline['output_tok_s']:8.1%}")
    for r in hf_runs:
        print(f"transformers generate {r.dtype} batch {r.batch}: {r.output_tok_s:.1f} tok/s")
    print_workload(workload, args, served_config)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": args.model, "input_len": args.input_len, "output_len": args.output_len,
        "temperature": args.temperature,
        "threads": default_num_threads(), "torch": torch.__version__, "attention_backend": backend,
        "matmul_gflops": gflops, "flops_per_output_token": per_output, "roofline": roofline,
        "engine": [asdict(r) for r in runs], "transformers": [asdict(r) for r in hf_runs],
        "served_workload": served_workload,
    }, indent=2))
    hf_rows = [{"dtype": f"transformers {r.dtype}", "concurrency": r.batch, "output_tok_s": r.output_tok_s}
               for r in hf_runs]
    png = plot_bars([asdict(r) for r in runs] + hf_rows, "concurrency", "dtype",
                    {"output_tok_s": "output tokens/s", "decode_ms_per_step_p50": "decode step p50 (ms)"},
                    out.with_suffix(".png"), title=f"engine, {args.input_len}-token prompts, {args.output_len} out")
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    main()
