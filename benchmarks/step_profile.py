"""Measure the engine's step time against its batch, fit the simulator's StepTimeModel, write a replica profile.

Runs the real engine in this process on synthetic loads (the simulator's own SyntheticWorkload, so the same
requests can be replayed in simulation) and records every step: prefill tokens, decoding requests, the context
tokens those decodes attend to, the prefill chunks' attention work, and the engine's own step time. A
calibration set of loads (batches of several sizes and lengths, then a Poisson mix) is fitted; a held-out
validation load is run, and its measured throughput is stored in the profile for `tests/test_autoscaling_simulator`
to check the simulator against.

    python -m benchmarks.step_profile --model ~/.cache/tokenline/SmolLM2-135M-Instruct.Q4_1.gguf \
        --out autoscaling/profiles/smollm2-135m-cpu-bf16.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from autoscaling.step_model import EngineShape, ReplicaProfile, StepSample, StepTimeModel
from autoscaling.workload import RequestSpec, SyntheticWorkload
from deployments.config import AppArgs
from deployments.run import applications
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loader import load_model_source

log = logging.getLogger("step_profile")

CALIBRATION = (
    SyntheticWorkload(num_requests=1, input_mean=512, output_mean=48, seed=1),
    SyntheticWorkload(num_requests=4, input_mean=1024, input_std=256, output_mean=48, seed=2),
    SyntheticWorkload(num_requests=16, input_mean=256, input_std=128, output_mean=64, output_std=16, seed=3),
    SyntheticWorkload(num_requests=48, input_mean=128, input_std=64, output_mean=64, output_std=16, seed=4),
    SyntheticWorkload(num_requests=64, rate=3.0, input_mean=300, input_std=200, output_mean=96, output_std=48,
                      seed=5),
)
# More requests than the engine runs at once, all at once: queueing, chunked prefill beside decodes, preemption.
TRIM_SLOW = 0.3
VALIDATION = SyntheticWorkload(num_requests=96, input_mean=300, input_std=150, output_mean=100, output_std=40,
                               seed=11)


@dataclass(frozen=True)
class RunRecord:
    """One workload on the real engine: every step, and what the requests got."""

    samples: list[StepSample]
    wall_s: float  # first arrival to last token
    output_tokens: int
    num_preemptions: int
    ttft_s: list[float]

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s


def run_workload(engine: LLMEngine, requests: list[RequestSpec], seed: int = 0) -> RunRecord:
    """Replays `requests` on the engine on the wall clock (each added once its arrival time has passed)."""
    rng = np.random.default_rng(seed)
    vocab = engine.model_args.vocab_size
    pending = deque(sorted(enumerate(requests), key=lambda item: item[1].arrival_s))
    tracked: dict[str, object] = {}
    arrived: dict[str, float] = {}
    first_token: dict[str, float] = {}
    samples: list[StepSample] = []
    output_tokens = 0
    preemptions_before = engine.stats().num_preemptions
    start = time.perf_counter()
    last_token = start
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0][1].arrival_s <= now:
            index, spec = pending.popleft()
            request_id = f"profile-{seed}-{index}"
            prompt = rng.integers(300, min(vocab, 40000), spec.prompt_tokens).tolist()
            engine.add_request(request_id, prompt, SamplingParams(max_tokens=spec.output_tokens, temperature=0,
                                                                   ignore_eos=True))
            tracked[request_id] = engine.requests[request_id]
            arrived[request_id] = start + spec.arrival_s
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][1].arrival_s - now))
            continue
        before = {rid: r.num_computed_tokens for rid, r in tracked.items()}
        outputs = engine.step()
        stamp = time.perf_counter()
        for out in outputs:
            output_tokens += len(out.new_token_ids)
            first_token.setdefault(out.request_id, stamp)
            last_token = stamp
        if engine.step_history:
            samples.append(_sample(tracked, before, engine.step_history[-1].duration_s))
        for rid in [rid for rid, r in tracked.items() if r.is_finished]:
            del tracked[rid]
    return RunRecord(samples, last_token - start, output_tokens,
                     engine.stats().num_preemptions - preemptions_before,
                     [first_token[rid] - arrived[rid] for rid in first_token])


def _sample(tracked: dict, before: dict[str, int], seconds: float) -> StepSample:
    """The step's batch, read from how far each request got (prefix caching is off, so all of it was computed)."""
    prefill = decodes = context = 0
    attention = 0.0
    for rid, request in tracked.items():
        start, end = before[rid], request.num_computed_tokens
        num_new = end - start
        if num_new <= 0:
            continue  # not scheduled, or preempted this step
        if num_new == 1 and start >= request.num_prompt_tokens:
            decodes += 1
            context += end
        else:
            prefill += num_new
            attention += num_new * (start + num_new / 2) / 1e6
    return StepSample(prefill, decodes, context, attention, seconds)


def make_engine(model: str, dtype: str, threads: int, kv_cache_memory_bytes: int, num_kv_blocks: int | None,
                max_num_batched_tokens: int, max_num_seqs: int, source=None,
                max_tokens_with_decodes: int | None = None) -> LLMEngine:
    # Prefix caching off: a step's computed tokens are then exactly how far its requests moved.
    return LLMEngine(EngineConfig(model=model, dtype=dtype, num_threads=threads, num_kv_blocks=num_kv_blocks,
                                  kv_cache_memory_bytes=kv_cache_memory_bytes, enable_prefix_caching=False,
                                  max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                  max_tokens_with_decodes=max_tokens_with_decodes, step_history=1 << 16),
                     source=source)


def engine_shape(engine: LLMEngine) -> EngineShape:
    return EngineShape(block_size=engine.config.block_size, num_kv_blocks=engine.runner.num_blocks,
                       max_num_batched_tokens=engine.config.max_num_batched_tokens,
                       max_num_seqs=engine.config.max_num_seqs,
                       max_tokens_with_decodes=engine.config.max_tokens_with_decodes)


SERVE_CONFIG = Path(__file__).resolve().parent.parent / "serve_config.yaml"
# The engine settings a profile follows from the app's config: its scheduler's budgets and its KV pool. Its
# threads are the replica's own CPUs (`engine_num_cpus`); borrowing an idle neighbour's (`prefill_threads`,
# `decode_threads`) is a replica's luck, not its capacity, and shows in its step correction instead.
SHAPE_FIELDS = ("dtype", "kv_cache_memory_bytes", "max_num_batched_tokens", "max_tokens_with_decodes",
                "max_num_seqs")


def serve_app_args(path: str | Path = SERVE_CONFIG) -> dict:
    """The `args` of the first application in a Serve config file (deployments.config.AppArgs' fields), read as
    `make serve` reads it."""
    [(_, args)], _ = applications(str(path), [])
    return args


def serve_engine_settings(path: str | Path = SERVE_CONFIG) -> dict:
    """The engine settings of the first application in a Serve config file as the SLO policy runs its engines (the
    profile is what that policy plans with), and its CPUs per engine replica."""
    args = serve_app_args(path)
    slo_args = {**args, "autoscaling": {**(args.get("autoscaling") or {}), "enabled": True, "policy": "slo"}}
    engine = AppArgs(**slo_args).engine_config()
    return {"threads": int(args.get("engine_num_cpus", 1)), **{k: getattr(engine, k) for k in SHAPE_FIELDS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--serve-config", default=str(SERVE_CONFIG),
                        help="the engine settings below default to this Serve config's (serve_config.yaml)")
    parser.add_argument("--name", default="smollm2-135m-cpu-bf16")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1, help="torch threads: an engine replica's CPUs")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=512 << 20)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-tokens-with-decodes", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--out", default="autoscaling/profiles/smollm2-135m-cpu-bf16.json")
    parser.set_defaults(**serve_engine_settings(parser.parse_known_args()[0].serve_config))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    load_before = os.getloadavg()[0]
    if load_before > 1.0:
        log.warning("load average %.1f: other processes share the CPU, and the steps they slow are dropped from "
                    "the fit but not from the validation run", load_before)
    source = load_model_source(args.model)
    engine = make_engine(args.model, args.dtype, args.threads, args.kv_cache_memory_bytes, args.num_kv_blocks,
                         args.max_num_batched_tokens, args.max_num_seqs, source, args.max_tokens_with_decodes)
    engine.settle()
    run_workload(engine, SyntheticWorkload(num_requests=2, input_mean=64, output_mean=8).requests())  # warm-up
    samples: list[StepSample] = []
    for workload in CALIBRATION:
        record = run_workload(engine, workload.requests(), workload.seed)
        samples += record.samples
        log.info("calibration %d requests: %d steps, %.1f s, %.1f output tok/s", workload.num_requests,
                 len(record.samples), record.wall_s, record.output_tok_s)
    # Steps far slower than the fit lost their core to another process: the profile models the engine alone.
    model = StepTimeModel.fit(samples, trim_slow=TRIM_SLOW)
    errors = np.abs(model.relative_errors(samples))
    log.info("fit %s: median |error| %.1f%%, p90 %.1f%%", model, 100 * np.median(errors),
             100 * np.percentile(errors, 90))

    validation = run_workload(engine, VALIDATION.requests(), VALIDATION.seed)
    held_out = np.abs(model.relative_errors(validation.samples))
    log.info("validation: %.1f output tok/s over %.1f s, %d preemptions; step |error| median %.1f%%",
             validation.output_tok_s, validation.wall_s, validation.num_preemptions, 100 * np.median(held_out))
    profile = ReplicaProfile(
        name=args.name, step_model=model, engine=engine_shape(engine),
        description=(f"{Path(args.model).name}, {args.dtype}, {args.threads} torch thread(s), "
                     f"{engine.runner.attention_backend} attention, on {platform.processor() or platform.machine()}"
                     f"; written by benchmarks/step_profile.py"),
        validation={"workload": dataclasses.asdict(VALIDATION),
                    "measured": {"output_tok_s": round(validation.output_tok_s, 2),
                                 "wall_s": round(validation.wall_s, 2), "output_tokens": validation.output_tokens,
                                 "preemptions": validation.num_preemptions,
                                 "step_error_median": round(float(np.median(held_out)), 4)}})
    extra = {"fit": {"samples": len(samples), "trim_slow": TRIM_SLOW,
                     "median_abs_rel_error": round(float(np.median(errors)), 4),
                     "p90_abs_rel_error": round(float(np.percentile(errors, 90)), 4)},
             "torch": torch.__version__, "load_average": [round(x, 2) for x in (load_before, os.getloadavg()[0])]}
    # One line per sample: (prefill tokens, decoding requests, context tokens, prefill attention, seconds).
    rows = ",\n".join("    " + json.dumps([s.prefill_tokens, s.decode_seqs, s.context_tokens,
                                            round(s.prefill_attention, 6), round(s.seconds, 6)]) for s in samples)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(profile.to_json(extra)[:-2] + f',\n  "samples": [\n{rows}\n  ]\n}}\n')
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
