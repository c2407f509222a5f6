"""`make gpu-check`: the GPU path checked and measured on a machine with a GPU and no network.

Runs with the Python already there (torch, Triton, transformers, safetensors, pytest; no Ray, no gguf, nothing
installed, nothing downloaded):

1. the Triton kernel and CUDA-graph tests, on CUDA, against the torch backend (pytest);
2. greedy tokens of the engine on CUDA (Triton backend, with and without CUDA graphs) against the CPU engine on
   the same random-weight model, in float32;
3. bench-engine-style numbers with random weights in SmolLM2-135M's and Llama-3-8B's shapes, bf16: decode ms/step
   and tok/s at batch 1, 32 and 128 with and without CUDA graphs, and prefill tok/s.

    python -m benchmarks.gpu_check --out results/gpu_check.json
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import ModelArgs

if TYPE_CHECKING:
    from engine.loader import CheckpointTensor

log = logging.getLogger("gpu_check")
ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = ["tests/test_triton_attention.py", "tests/test_cuda_graphs.py"]

SHAPES = {
    "smollm2-135m": ModelArgs("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                              num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                              max_position_embeddings=8192, tie_word_embeddings=True),
    "llama-3-8b": ModelArgs("llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                            num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                            max_position_embeddings=8192, tie_word_embeddings=False,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
# Parity: small enough for the CPU engine, GQA group 4, sharp logits so greedy choices are not near-ties.
PARITY_SHAPE = ModelArgs("llama", vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                         num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                         max_position_embeddings=2048, tie_word_embeddings=False)


class RandomWeights:
    """A checkpoint of random tensors named as transformers names them, made one at a time as the loader reads
    them, on `device`: an 8B model never exists twice."""

    def __init__(self, args: ModelArgs, device: torch.device, dtype: torch.dtype, seed: int, std: float) -> None:
        self.args, self.device, self.dtype, self.seed, self.std = args, device, dtype, seed, std

    def shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        a = self.args
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        yield "model.embed_tokens.weight", (a.vocab_size, a.hidden_size)
        for i in range(a.num_layers):
            p = f"model.layers.{i}."
            yield from ((p + "input_layernorm.weight", (a.hidden_size,)),
                        (p + "post_attention_layernorm.weight", (a.hidden_size,)),
                        (p + "self_attn.q_proj.weight", (q, a.hidden_size)),
                        (p + "self_attn.k_proj.weight", (kv, a.hidden_size)),
                        (p + "self_attn.v_proj.weight", (kv, a.hidden_size)),
                        (p + "self_attn.o_proj.weight", (a.hidden_size, q)),
                        (p + "mlp.gate_proj.weight", (a.intermediate_size, a.hidden_size)),
                        (p + "mlp.up_proj.weight", (a.intermediate_size, a.hidden_size)),
                        (p + "mlp.down_proj.weight", (a.hidden_size, a.intermediate_size)))
        yield "model.norm.weight", (a.hidden_size,)
        if not a.tie_word_embeddings:
            yield "lm_head.weight", (a.vocab_size, a.hidden_size)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        gen = torch.Generator(self.device).manual_seed(self.seed)
        for name, shape in self.shapes():
            t = torch.randn(shape, generator=gen, device=self.device, dtype=torch.float32)
            yield name, ((1 + 0.1 * t) if len(shape) == 1 else t * self.std).to(self.dtype)

    def __iter__(self) -> Iterator[tuple[str, "CheckpointTensor"]]:
        """The engine's lazy-checkpoint form: (name, CheckpointTensor) pairs, still made one at a time."""
        from engine.loader import CheckpointTensor

        return ((name, CheckpointTensor.of(t)) for name, t in self.items())


def random_source(args: ModelArgs, device: str, dtype: torch.dtype, seed: int = 0, std: float = 0.02):
    return args, RandomWeights(args, torch.device(device), dtype, seed, std)


def run_kernel_tests() -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    summary = lines[-1] if lines else proc.stderr[-500:]
    log.info("kernel tests: %s", summary)
    if proc.returncode:
        log.error("kernel tests failed:\n%s", proc.stdout[-6000:])
    return {"passed": proc.returncode == 0, "summary": summary, "seconds": round(time.perf_counter() - start, 1)}


def greedy_tokens(device: str, backend: str, enforce_eager: bool, prompts: list[list[int]]) -> list[list[int]]:
    config = EngineConfig(model="random-parity", dtype="float32", device=device, attention_backend=backend,
                          num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=256, enforce_eager=enforce_eager)
    # Weights drawn on the CPU, so both devices load the very same numbers.
    engine = LLMEngine(config, source=random_source(PARITY_SHAPE, "cpu", torch.float32, seed=1, std=0.15))
    return engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))


def run_parity(device: str = "cuda") -> dict:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, PARITY_SHAPE.vocab_size, (n,), generator=gen).tolist()
               for n in (1, 7, 16, 33, 90, 200, 301, 17)]
    cpu = greedy_tokens("cpu", "torch", True, prompts)
    out = {}
    for name, eager in (("cuda_graphs", False), ("eager", True)):
        got = greedy_tokens(device, "auto", eager, prompts)
        same = sum(g == c for g, c in zip(got, cpu))
        out[name] = {"identical_requests": same, "requests": len(prompts)}
        log.info("greedy tokens on %s (%s) vs CPU: %d of %d requests identical", device, name, same, len(prompts))
    out["passed"] = all(v["identical_requests"] == len(prompts) for v in out.values())
    return out


@dataclass
class DecodeRow:
    shape: str
    batch: int
    cuda_graphs: bool
    ms_per_step: float
    tok_s: float


def decode_run(engine: LLMEngine, batch: int, prompt_len: int, steps: int, graphs: bool, seed: int) -> float:
    """Median ms of a decode step of `batch` requests, each `prompt_len` tokens in."""
    if engine.runner.graph_runner is not None:
        engine.runner.graph_runner.enabled = graphs
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_args.vocab_size
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{seed}-{i}", torch.randint(3, vocab, (prompt_len,), generator=gen).tolist(), params)
    times = []
    while engine.has_unfinished():
        engine.step()
        s = engine.step_history[-1]
        if s.num_prefill_tokens == 0 and s.num_decode_tokens == batch:
            times.append(s.duration_s)
    return 1000 * statistics.median(times[2:] or times)  # the first decodes compile kernels or warm caches


def prefill_run(engine: LLMEngine, num_requests: int, prompt_len: int, seed: int) -> float:
    """Prompt tokens per second over steps that only prefill (every prompt new: no prefix-cache hit)."""
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    first = len(engine.step_history) and engine.step_history[-1].step
    for i in range(num_requests):
        engine.add_request(f"p{seed}-{i}", torch.randint(3, engine.model_args.vocab_size, (prompt_len,),
                                                          generator=gen).tolist(), params)
    while engine.has_unfinished():
        engine.step()
    steps = [s for s in engine.step_history if s.step > first and s.num_prefill_tokens]
    return sum(s.num_prefill_tokens for s in steps) / sum(s.duration_s for s in steps)


def bench_shape(name: str, args: ModelArgs, device: str, batches: list[int], prompt_len: int, steps: int,
                dtype: str = "bfloat16", max_model_len: int = 2048,
                num_kv_blocks: int | None = None, prefill: tuple[int, int] = (16, 512)
                ) -> tuple[list[DecodeRow], float, dict]:
    """One engine (the KV pool sized by gpu_memory_utilization unless num_kv_blocks is given), timed with and
    without its CUDA graphs at each batch size, then on prefill-only steps."""
    config = EngineConfig(model=f"random-{name}", dtype=dtype, device=device, max_num_seqs=max(batches),
                          max_num_batched_tokens=8192, max_model_len=max_model_len, enable_prefix_caching=False,
                          num_kv_blocks=num_kv_blocks)
    start = time.perf_counter()
    engine = LLMEngine(config, source=random_source(args, device, config.torch_dtype))
    info = {"start_s": round(time.perf_counter() - start, 1), "attention_backend": engine.runner.attention_backend,
            "cuda_graphs": engine.cuda_graphs, "num_kv_blocks": engine.runner.num_blocks}
    log.info("%s: engine ready in %.1f s (%s)", name, info["start_s"], info)
    rows = []
    for batch in batches:
        for graphs in ((True, False) if engine.cuda_graphs else (False,)):
            ms = decode_run(engine, batch, prompt_len, steps, graphs, seed=batch)
            rows.append(DecodeRow(name, batch, graphs, round(ms, 3), round(batch * 1000 / ms, 1)))
            log.info("%s batch %d graphs=%s: %.2f ms/step, %.0f tok/s", name, batch, graphs, ms, rows[-1].tok_s)
    prefill_tok_s = max(prefill_run(engine, *prefill, seed=1000 + r) for r in range(3))
    log.info("%s prefill: %.0f tok/s", name, prefill_tok_s)
    del engine
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows, prefill_tok_s, info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/gpu_check.json")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--skip-tests", action="store_true", help="only the parity check and the benchmark")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not torch.cuda.is_available():
        sys.exit("gpu-check needs a CUDA GPU: torch.cuda.is_available() is False here")
    import triton

    props = torch.cuda.get_device_properties(0)
    report: dict = {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / (1 << 30), 1),
                    "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}
    log.info("%s", report)
    report["kernel_tests"] = None if args.skip_tests else run_kernel_tests()
    report["parity"] = run_parity()
    report["decode"], report["prefill_tok_s"], report["engines"] = [], {}, {}
    for name in args.shapes:
        rows, prefill, info = bench_shape(name, SHAPES[name], "cuda", args.batches, prompt_len=256, steps=32)
        report["decode"] += [asdict(r) for r in rows]
        report["prefill_tok_s"][name] = round(prefill)
        report["engines"][name] = info
    print(f"\n{report['gpu']}, torch {report['torch']}, triton {report['triton']}")
    if report["kernel_tests"]:
        print(f"kernel tests on CUDA: {report['kernel_tests']['summary']}")
    print(f"greedy tokens CUDA vs CPU: {'identical' if report['parity']['passed'] else 'DIFFERENT'} "
          f"({report['parity']})")
    print(f"{'shape':14} {'batch':>5} {'graphs':>6} {'ms/step':>8} {'decode tok/s':>12}")
    for r in report["decode"]:
        print(f"{r['shape']:14} {r['batch']:5d} {str(r['cuda_graphs']):>6} {r['ms_per_step']:8.2f} {r['tok_s']:12.0f}")
    for name, tok_s in report["prefill_tok_s"].items():
        print(f"{name} prefill: {tok_s} tok/s (16 prompts of 512 tokens)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    failed = (report["kernel_tests"] and not report["kernel_tests"]["passed"]) or not report["parity"]["passed"]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
