"""Structured output's cost: output tokens/s at concurrency 8 with and without a JSON schema, engine level.

A closed loop keeps 8 requests in the engine (a finished one is replaced at once) until `--requests` have
finished, plain and with a JSON schema in turn (`--rounds` times each, interleaved, so load on the machine hits
both alike); the schema's grammar is compiled before timing (the cache keeps it). Plain requests run to
`--max-tokens` (ignore_eos); the schema is an array of long bounded strings, so a JSON answer also runs about
that long. Prints a table and writes JSON.

    python -m benchmarks.bench_structured --model ~/.cache/tokenline/SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loader import load_tokenizer
from engine.sampling_params import StructuredOutput

log = logging.getLogger(__name__)

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "points": {"type": "array", "items": {"type": "string", "minLength": 20, "maxLength": 60},
               "minItems": 4, "maxItems": 4}},
    "required": ["title", "points"], "additionalProperties": False}


def closed_loop(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, concurrency: int,
                num_requests: int) -> tuple[int, float]:
    """Output tokens and seconds for `num_requests` requests, `concurrency` at a time."""
    sent = done = tokens = 0
    start = time.perf_counter()
    while done < num_requests:
        while sent < num_requests and sent - done < concurrency:
            engine.add_request(f"b{time.monotonic_ns()}-{sent}", prompts[sent % len(prompts)], params)
            sent += 1
        for out in engine.step():
            tokens += len(out.new_token_ids)
            done += out.finished
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="results/bench_structured.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    tokenizer = load_tokenizer(args.model)
    engine = LLMEngine(EngineConfig(model=args.model))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Give four points about topic {i}."}],
                                             add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
               for i in range(16)]
    modes = {"plain": SamplingParams(max_tokens=args.max_tokens, temperature=0.8, ignore_eos=True),
             "json_schema": SamplingParams(max_tokens=args.max_tokens, temperature=0.8,
                                           structured_output=StructuredOutput(json=json.dumps(SCHEMA)))}
    for params in modes.values():  # warm-up: kernels, the tokenizer and the schema's grammar
        engine.generate(prompts[:2], params)
    runs: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(args.rounds):
        for name, params in modes.items():
            tokens, seconds = closed_loop(engine, prompts, params, args.concurrency, args.requests)
            runs[name].append(tokens / seconds)
            log.info("%s: %d tokens in %.1f s, %.1f tok/s", name, tokens, seconds, tokens / seconds)
    result = {name: {"output_tok_s_median": statistics.median(v), "runs": v} for name, v in runs.items()}
    ratio = statistics.median(j / p for j, p in zip(runs["json_schema"], runs["plain"]))
    result["json_over_plain"] = ratio
    result["settings"] = vars(args)
    log.info("\nconcurrency %d, %d requests per run, %d rounds\n%-12s %12s\n%s\njson_schema / plain (median of "
             "per-round ratios): %.3f", args.concurrency, args.requests, args.rounds, "mode", "out tok/s",
             "\n".join(f"{n:12} {result[n]['output_tok_s_median']:12.1f}" for n in modes), ratio)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
