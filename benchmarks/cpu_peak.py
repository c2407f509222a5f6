"""This CPU's arithmetic ceiling: fp32 FMA GFLOP/s on 1..N threads, and the decode tok/s it allows a model.

A loop of independent 256-bit FMAs (AVX2; 512-bit where the CPU has AVX-512F), 12 chains a thread so that the
FMA units, not their latency, bound it, compiled here with the system's C compiler and run on each thread count
(one pinned thread a CPU). The best of `--repeats` is the peak: what no kernel of fp32 FMAs can pass, whatever its
memory traffic. Beside it the same loop of int16 dot products (`vpmaddwd`, then the int32 add that accumulates
them: what an int8 or int16 kernel without VNNI runs), in multiply-adds a second, against the FMAs' 2 FLOPs each.
A decode token costs 2 FLOPs a weight of the linears and the LM head, plus attention over its context; with
`--model` it prints the decode tok/s a batch of `--batch` could reach at that peak, every FLOP an FMA at full rate.

    python -m benchmarks.cpu_peak --threads 1,2 --model ~/.cache/tokenline/SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#ifdef __AVX512F__
typedef __m512 vec;
typedef __m512i ivec;
#define LANES 16
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define FIRST(v) _mm512_cvtss_f32(v)
#define ISET1 _mm512_set1_epi16
#define IMADD(a, x, w) _mm512_add_epi32(a, _mm512_madd_epi16(x, w))
#define IFIRST(v) _mm_cvtsi128_si32(_mm512_castsi512_si128(v))
#else
typedef __m256 vec;
typedef __m256i ivec;
#define LANES 8
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define FIRST(v) _mm256_cvtss_f32(v)
#define ISET1 _mm256_set1_epi16
#define IMADD(a, x, w) _mm256_add_epi32(a, _mm256_madd_epi16(x, w))
#define IFIRST(v) _mm_cvtsi128_si32(_mm256_castsi256_si128(v))
#endif
#define CHAINS 12

static long iterations;
static int int16_dots;
static pthread_barrier_t start;
static double seconds[1024];
static float sink[1024];

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void* run(void* arg) {
  long id = (long)arg;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET((int)id, &set);
  sched_setaffinity(0, sizeof(set), &set);
  pthread_barrier_wait(&start);
  double t0 = now();
  float s = 0;
  if (int16_dots) {
    /* 6 x values against 2 weights: 12 sums, each a dot product of int16 pairs added into int32 lanes */
    ivec acc[CHAINS], x[CHAINS / 2], w0 = ISET1(5), w1 = ISET1(7);
    for (int i = 0; i < CHAINS; ++i) acc[i] = ISET1(0);
    for (int i = 0; i < CHAINS / 2; ++i) x[i] = ISET1((short)(i + 1));
    for (long n = 0; n < iterations; ++n) {
#pragma GCC unroll 6
      for (int i = 0; i < CHAINS / 2; ++i) {
        acc[2 * i] = IMADD(acc[2 * i], x[i], w0);
        acc[2 * i + 1] = IMADD(acc[2 * i + 1], x[i], w1);
      }
      __asm__ volatile("" : "+x"(w0), "+x"(w1));
    }
    seconds[id] = now() - t0;
    for (int i = 0; i < CHAINS; ++i) s += (float)IFIRST(acc[i]);
  } else {
    vec acc[CHAINS], b = SET1(0.999f), c = SET1(1e-3f);
    for (int i = 0; i < CHAINS; ++i) acc[i] = SET1((float)i);
    for (long n = 0; n < iterations; ++n) {
#pragma GCC unroll 12
      for (int i = 0; i < CHAINS; ++i) acc[i] = FMA(b, acc[i], c);
      __asm__ volatile("" : "+x"(b), "+x"(c));
    }
    seconds[id] = now() - t0;
    for (int i = 0; i < CHAINS; ++i) s += FIRST(acc[i]);
  }
  sink[id] = s;
  return NULL;
}

int main(int argc, char** argv) {
  int threads = atoi(argv[1]);
  iterations = atol(argv[2]);
  int16_dots = argc > 3 && argv[3][0] == 'i';
  pthread_t t[1024];
  pthread_barrier_init(&start, NULL, threads);
  for (long i = 0; i < threads; ++i) pthread_create(&t[i], NULL, run, (void*)i);
  double slowest = 0;
  for (int i = 0; i < threads; ++i) {
    pthread_join(t[i], NULL);
    if (seconds[i] > slowest) slowest = seconds[i];
  }
  printf("%d %.6f %g\n", LANES, slowest, (double)sink[0]);
  return 0;
}
"""


def build(workdir: Path) -> Path:
    if platform.machine() != "x86_64":
        raise SystemExit(f"cpu_peak: its FMA loop is x86-64 (AVX2 or AVX-512), this is {platform.machine()}")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("cpu_peak: no C compiler (cc or gcc) on PATH")
    source, binary = workdir / "fma_peak.c", workdir / "fma_peak"
    source.write_text(SOURCE)
    subprocess.run([compiler, "-O2", "-march=native", "-pthread", str(source), "-o", str(binary)], check=True)
    return binary


def peak_rate(binary: Path, threads: int, iterations: int, repeats: int, int16_dots: bool = False) -> tuple[float, int]:
    """The best of `repeats` runs of `threads` threads together: fp32 GFLOP/s of FMAs (2 a lane), or with
    `int16_dots` G int16 multiply-adds a second (2 a 32-bit lane); and the vector's fp32 lanes."""
    best = 0.0
    lanes = 0
    for _ in range(repeats):
        out = subprocess.run([str(binary), str(threads), str(iterations)] + (["int16"] if int16_dots else []),
                             check=True, capture_output=True, text=True).stdout.split()
        lanes, slowest = int(out[0]), float(out[1])
        best = max(best, threads * iterations * 12 * lanes * 2 / slowest / 1e9)
    return best, lanes


def decode_flops(model: str, context: int) -> tuple[float, str]:
    """FLOPs of one decode token (bench_engine's count: 2 a weight of every linear and the LM head, and
    attention's QK and PV over `context` tokens), and the model's shape in words."""
    from benchmarks.bench_engine import flops_per_token
    from engine.loader import read_model_args

    args = read_model_args(model)
    shape = f"{args.num_layers} layers, hidden {args.hidden_size}, vocab {args.vocab_size}"
    return flops_per_token(args, context), shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default=",".join(str(n) for n in sorted({1, os.cpu_count() or 1})),
                        help="comma-separated thread counts (default: 1 and every CPU)")
    parser.add_argument("--iterations", type=int, default=20_000_000, help="loop trips a thread (12 FMAs each)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", help="also print the decode tok/s this peak allows the model")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=300, help="tokens each decode attends to")
    parser.add_argument("--out", default="results/cpu_peak.json")
    args = parser.parse_args()

    result: dict = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": {},
                    "int16_gmacs": {}}
    with tempfile.TemporaryDirectory(prefix="cpu-peak-") as tmp:
        binary = build(Path(tmp))
        for threads in (int(n) for n in args.threads.split(",")):
            gflops, lanes = peak_rate(binary, threads, args.iterations, args.repeats)
            gmacs, _ = peak_rate(binary, threads, args.iterations, args.repeats, int16_dots=True)
            result["threads"][threads] = gflops
            result["int16_gmacs"][threads] = gmacs
            result["vector_lanes"] = lanes
            print(f"{threads} thread(s): {gflops:.1f} GFLOP/s fp32 FMA peak ({lanes}-lane vectors: "
                  f"{gflops / 2:.1f} G multiply-adds/s); int16 dot products {gmacs:.1f} G multiply-adds/s")
    if args.model:
        flops, shape = decode_flops(args.model, args.context)
        top = max(result["threads"].values())
        step_ms = flops * args.batch / (top * 1e9) * 1000
        result["model"] = {"path": args.model, "shape": shape, "decode_mflop_per_token": flops / 1e6,
                           "batch": args.batch, "context": args.context, "min_step_ms": step_ms,
                           "max_decode_tok_s": args.batch / step_ms * 1000}
        print(f"{shape}: {flops / 1e6:.0f} MFLOP a decode token at {args.context} tokens of context; a batch of "
              f"{args.batch} at {top:.0f} GFLOP/s: at least {step_ms:.1f} ms a step, at most "
              f"{args.batch / step_ms * 1000:.0f} decode tok/s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
