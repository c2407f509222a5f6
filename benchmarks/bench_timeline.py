"""What request events and the step ring cost the engine: one LLMEngine, the same prompts, events on and off in
turn (interleaved, so drift in the machine's load falls on both alike). Prints each pair and the median ratio.

    python -m benchmarks.bench_timeline --model ~/.cache/tokenline/SmolLM2-135M-Instruct.Q4_1.gguf --pairs 6
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine import EngineConfig, LLMEngine, SamplingParams

OFF_STEP_HISTORY = EngineConfig.__dataclass_fields__["step_history"].default


@dataclass
class Run:
    events: bool
    wall_s: float
    cpu_s: float  # this process's CPU time (the step loop and torch's threads)
    output_tokens: int


@dataclass
class Report:
    runs: list[Run] = field(default_factory=list)
    wall_cost: float = 0.0  # median over pairs of (on / off - 1), wall time per token
    cpu_cost: float = 0.0  # median over pairs of (on / off - 1), CPU time per token


def one_run(engine: LLMEngine, events: bool, step_ring: int, prompts: list[list[int]],
            params: SamplingParams) -> Run:
    engine.config.record_request_events = events
    engine.step_history = deque(maxlen=step_ring if events else OFF_STEP_HISTORY)
    engine.kv.reset_prefix_cache()
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = engine.generate(prompts, params)
    return Run(events, time.perf_counter() - wall, time.process_time() - cpu, sum(len(o) for o in outputs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--step-ring", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=Path("results/bench_timeline.json"))
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=str(Path(args.model).expanduser()), num_threads=2))
    engine.settle()
    rng = random.Random(0)
    prompts = [[rng.randrange(300, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.concurrency)]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    one_run(engine, True, args.step_ring, prompts[:4], params)  # warm-up
    report = Report()
    for pair in range(args.pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        runs = [one_run(engine, events, args.step_ring, prompts, params) for events in order]
        report.runs += runs
        print("  ".join(f"events {'on ' if r.events else 'off'}: {r.output_tokens / r.wall_s:6.1f} tok/s, "
                        f"{r.cpu_s / r.output_tokens * 1e3:5.2f} CPU ms/tok" for r in runs), flush=True)

    def ratios(value) -> list[float]:
        """Per pair, events on over events off: a pair that other work disturbed does not drag the median."""
        pairs = [report.runs[i:i + 2] for i in range(0, len(report.runs), 2)]
        return [value(next(r for r in p if r.events)) / value(next(r for r in p if not r.events)) for p in pairs]

    report.wall_cost = statistics.median(ratios(lambda r: r.wall_s / r.output_tokens)) - 1
    report.cpu_cost = statistics.median(ratios(lambda r: r.cpu_s / r.output_tokens)) - 1
    print(f"events on vs off, median of {args.pairs} pairs: {report.wall_cost:+.2%} wall time per token, "
          f"{report.cpu_cost:+.2%} CPU time per token")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(asdict(report), indent=2))


if __name__ == "__main__":
    main()
