"""Where an engine step's time goes, at decode batch 1 and 32 and in a lone 256-token prefill: the step's own
phases (scheduling, input preparation, forward, sampling, output handling, from the step trace), and the forward
pass split by kind of operator (each projection, the LM head, attention, norms, RoPE, SiLU, the KV write), from
the torch profiler.

Random 256-token prompts, prefilled first; then decode steps are timed and profiled; then a lone prompt is
prefilled in one step, several times. Prints a table and writes JSON. For the serving path's share (proxy,
ingress, Ray hops), `make bench-serve` reports CPU per output token by process.

    python -m benchmarks.step_breakdown --model ~/.cache/tokenline/SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_engine import random_prompts
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import ModelArgs
from engine.kernels import native_linear_available
from engine.loader import load_model_source
from engine.models.layers import Linear, linears_described
from engine.outputs import STEP_PHASES

log = logging.getLogger("step_breakdown")

PHASES = (*STEP_PHASES, "outputs")


def linear_kinds(args: ModelArgs) -> dict[tuple[int, int], str]:
    """(out_features, in_features) of each projection, to tell the profiler's linear calls apart."""
    q, kv, h = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim, args.hidden_size
    return {(q + 2 * kv, h): "qkv_proj", (h, q): "o_proj", (2 * args.intermediate_size, h): "gate_up_proj",
            (h, args.intermediate_size): "down_proj", (args.vocab_size, h): "lm_head"}


def op_kind(name: str, shapes: list, kinds: dict[tuple[int, int], str]) -> str:
    if "linear_silu_mul" in name:  # gate/up's linear with SiLU-and-mul in its epilogue (Linear.silu_mul)
        return "gate_up_proj + silu"
    if "linear" in name:  # packed_linear(out, x, ...), mkldnn::_linear_pointwise(x, w), aten::linear(x, w)
        try:
            out, x = (shapes[0], shapes[1]) if "packed" in name else (None, shapes[0])
            n = out[-1] if out else shapes[1][0]
            return kinds.get((n, x[-1]), "other linear")
        except (IndexError, TypeError):
            return "other linear"
    for key, kind in (("attention", "attention"), ("rms_norm", "norms"), ("rotary", "rope"),
                      ("silu", "silu_and_mul"), ("write_kv", "kv write"), ("argmax", "sampling ops"),
                      ("softmax", "sampling ops"), ("embedding", "embedding")):
        if key in name:
            return kind
    return "other ops"


class LinearClock:
    """Wall time per step of each kind of projection called as a module (the Python layers, and the LM head on
    every path), timed around the module's call: the profiler's self times slow oneDNN's linears unevenly (at a
    lone 256-token prefill it put gate_up at 1.96 ms a call against 0.40 timed this way, down at 0.55 against 0.35,
    qkv and o about as timed), so where a projection runs as a module its time is this clock's, not the profiler's.
    Projections inside the native layers' one call are not modules there: a decode step's keep the profiler's split,
    a lone prefill's are clocked on the layers run as modules (timed_and_profiled's `clock_native`)."""

    def __init__(self, model: torch.nn.Module, kinds: dict[tuple[int, int], str]) -> None:
        self.total_s: dict[str, float] = defaultdict(float)
        self._started: dict[int, float] = {}
        self._handles = []
        self._patched: list[Linear] = []
        self._in_silu_mul = False
        for module in model.modules():
            weight = getattr(module, "weight", None)
            kind = kinds.get(tuple(weight.shape)) if isinstance(module, Linear) and weight is not None else None
            if kind is not None:
                self._handles.append(module.register_forward_pre_hook(self._pre))
                self._handles.append(module.register_forward_hook(functools.partial(self._post, kind)))
            if kind == "gate_up_proj":  # a fused MLP calls Linear.silu_mul, not the module: clocked as one kind
                module.silu_mul = functools.partial(self._silu_mul, module.silu_mul)
                self._patched.append(module)

    def _silu_mul(self, silu_mul, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        self._in_silu_mul = True  # its fallback calls the module: counted here, not twice
        try:
            return silu_mul(x)
        finally:
            self._in_silu_mul = False
            self.total_s["gate_up_proj + silu"] += time.perf_counter() - start

    def _pre(self, module, args) -> None:
        self._started[id(module)] = time.perf_counter()

    def _post(self, kind: str, module, args, out) -> None:
        started = self._started.pop(id(module))
        if not self._in_silu_mul:
            self.total_s[kind] += time.perf_counter() - started

    def per_step_ms(self, steps: int) -> dict[str, float]:
        return {kind: seconds / steps * 1e3 for kind, seconds in self.total_s.items()}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for module in self._patched:
            del module.silu_mul  # the class's method again


def operator_split(prof, kinds: dict[tuple[int, int], str], measured_ms: float,
                   clocked: dict[str, float] | None = None) -> dict[str, float]:
    """Milliseconds a step by kind of operator: the `clocked` kinds as their clock read them (LinearClock), the
    others the profiler's self times scaled to what is left of `measured_ms` (the profiler slows every op: its
    shares are kept, its total is not)."""
    self_us: dict[str, float] = defaultdict(float)
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key.startswith(("tokenline::", "mkldnn::", "aten::")):
            self_us[op_kind(event.key, event.input_shapes, kinds)] += event.self_cpu_time_total
    clocked = clocked or {}
    for kind in clocked:
        self_us.pop(kind, None)
    total = sum(self_us.values()) or 1.0
    rest = max(0.0, measured_ms - sum(clocked.values()))
    split = {**{k: v / total * rest for k, v in self_us.items()}, **clocked}
    return dict(sorted(split.items(), key=lambda kv: -kv[1]))


def timed_and_profiled(engine: LLMEngine, run_once, steps: int,
                       clock_native: bool = False) -> tuple[dict[str, float], dict[str, float]]:
    """`run_once` (one engine step, with whatever it sets up) `steps` times for the phases (medians from the step
    records, ms), then `steps` times under the profiler for the operators. `clock_native`: where the decoder layers
    run as one native call, `steps` more times with them as modules (the same kernels on the same tensors, called
    from Python), so that the clock times the projections instead of the profiler (inside the native call it put a
    lone 256-token prefill's gate/up at 47 of 68 ms on an AMD EPYC, where that projection alone takes 27)."""
    first = engine.stats().num_steps
    kinds = linear_kinds(engine.model_args)
    model = engine.runner.model
    clock_modules = clock_native and getattr(model, "native_layers", False)
    clock = None if clock_modules else LinearClock(model, kinds)
    try:
        for _ in range(steps):
            run_once()
    finally:
        if clock is not None:
            clock.remove()
    if clock_modules:
        clock = LinearClock(model, kinds)
        model.native_layers = False
        try:
            for _ in range(steps):
                run_once()
        finally:
            model.native_layers = True
            clock.remove()
    history = [s for s in engine.step_history if s.step > first][:steps]
    med = {k: statistics.median(getattr(s, f"{k}_s") for s in history) * 1e3
           for k in STEP_PHASES}
    med["step"] = statistics.median(s.duration_s for s in history) * 1e3
    med["outputs"] = max(0.0, med["step"] - sum(med[k] for k in STEP_PHASES))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            run_once()
    return med, operator_split(prof, kinds, med["forward"] + med["sample"], clock.per_step_ms(steps))


def prefill_breakdown(engine: LLMEngine, length: int, steps: int, seed: int) -> dict:
    """A lone prompt of `length` tokens prefilled in one step (no prefix cached), `steps` times."""
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    prompts = iter(random_prompts(3 * steps + 2, length, seed))

    def one() -> None:
        engine.add_request("prefill", next(prompts), params)
        engine.step()
        engine.abort("prefill")

    one()  # warm
    med, ops = timed_and_profiled(engine, one, steps, clock_native=True)
    return {"prefill_tokens": length, "phases_ms": med, "ops_ms": ops, "prefill_tok_s": length / med["step"] * 1e3}


def breakdown(engine: LLMEngine, batch: int, steps: int, seed: int) -> dict:
    params = SamplingParams(max_tokens=steps * 2 + 8, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, 256, seed)):
        engine.add_request(f"b{batch}-{i}", prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    med, ops = timed_and_profiled(engine, engine.step, steps)
    for request_id in list(engine.requests):
        engine.abort(request_id)
    return {"batch": batch, "phases_ms": med, "ops_ms": ops, "decode_tok_s": batch / med["step"] * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prefill-len", type=int, default=256, help="also a lone prefill of this many tokens (0: no)")
    parser.add_argument("--prefill-steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: this process's CPUs)")
    parser.add_argument("--dtype", default="bfloat16", help="the engine's dtype (EngineConfig.dtype)")
    parser.add_argument("--quantization", default=None, choices=["int8"], help="int8 weight-only linears")
    parser.add_argument("--native-linear-max-rows", type=int, default=None,
                        help="steps of more rows run oneDNN's linears (default: where the CPU has AMX 80, or 6 "
                             "without the native kernel's AMX tiles; else none; 2048: the native kernel alone)")
    parser.add_argument("--linear-amx-tiles", choices=["on", "off"], default="on",
                        help="off: the native linear on its AVX512-BF16 dot products alone where it has AMX tiles "
                             "(and so oneDNN past 6 rows by default)")
    parser.add_argument("--out", default="results/step_breakdown.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.linear_amx_tiles == "off" and native_linear_available():
        torch.ops.tokenline.linear_amx_min_rows(0)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=128, num_threads=args.threads,
                                    quantization=args.quantization,
                                    native_linear_max_rows=args.native_linear_max_rows),
                       source=load_model_source(args.model))
    engine.settle()
    results = [breakdown(engine, int(b), args.steps, seed=int(b)) for b in args.batches.split(",")]
    prefill = prefill_breakdown(engine, args.prefill_len, args.prefill_steps, seed=7) if args.prefill_len else None
    linears = linears_described(engine.runner.linear_packing, engine.runner.native_max_rows)
    print(f"\n{args.dtype}, attention backend {engine.runner.attention_backend}, linears {linears}, "
          f"{torch.get_num_threads()} threads; milliseconds per decode step (median of {args.steps})")
    for r in results:
        phases = r["phases_ms"]
        print(f"\nbatch {r['batch']}: {phases['step']:.2f} ms a step, {r['decode_tok_s']:.0f} decode tok/s")
        print("  " + ", ".join(f"{k} {phases[k]:.2f}" for k in PHASES))
        print("  forward + sampling by operator: " + ", ".join(f"{k} {v:.2f}" for k, v in r["ops_ms"].items()))
    if prefill:
        phases = prefill["phases_ms"]
        print(f"\nprefill of {prefill['prefill_tokens']} tokens alone: {phases['step']:.2f} ms a step, "
              f"{prefill['prefill_tok_s']:.0f} prefill tok/s (median of {args.prefill_steps})")
        print("  " + ", ".join(f"{k} {phases[k]:.2f}" for k in PHASES))
        print("  forward + sampling by operator: " + ", ".join(f"{k} {v:.2f}" for k, v in prefill["ops_ms"].items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": torch.get_num_threads(), "attention_backend":
                               engine.runner.attention_backend, "linears": engine.runner.linear_packing,
                               "results": results, "prefill": prefill}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
