"""Where one stream's first token goes: sequential streamed completions against a running server, each asking for
its timeline (`X-Tokenline-Timeline: 1`), and the medians of each stage.

Random token-id prompts (256 by default), 128 output tokens with `ignore_eos`, greedy, one request at a time, as
`vllm bench serve` does at concurrency 1. Prints each request's time to first token and engine prefill, then the
medians of TTFT, output tok/s and every timeline stage (README: Where a request's time goes); JSON with `--out`.

    make serve   # in another shell
    python -m benchmarks.first_token --url http://127.0.0.1:8000 --requests 14
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

import httpx


def one_request(http: httpx.Client, model: str, prompt: list[int], output_tokens: int) -> tuple[float, float, dict]:
    """(time to first token, whole time, the timeline) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    started, first, timeline = time.perf_counter(), None, None
    with http.stream("POST", "/v1/completions", json=body, headers={"X-Tokenline-Timeline": "1"}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - started
            timeline = chunk.get("timeline", timeline)
    if first is None or timeline is None:
        raise RuntimeError("the server sent no token or no timeline")
    return first, time.perf_counter() - started, timeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=14)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    ttfts, totals, stages = [], [], defaultdict(list)
    with httpx.Client(base_url=args.url, headers=headers, timeout=120) as http:
        model = http.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        for _ in range(args.requests):
            prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
            ttft, total, timeline = one_request(http, model, prompt, args.output_tokens)
            ttfts.append(ttft)
            totals.append(total)
            for stage in timeline["stages"]:
                stages[stage["stage"]].append(stage["duration_s"])
    print("TTFT ms:", " ".join(f"{t * 1e3:.0f}" for t in ttfts))
    print("engine prefill ms:", " ".join(f"{t * 1e3:.0f}" for t in stages.get("prefill", [])))
    medians = {stage: statistics.median(values) for stage, values in stages.items()}
    ttft, total = statistics.median(ttfts), statistics.median(totals)
    print(f"median TTFT {ttft * 1e3:.1f} ms, request {total:.3f} s, {args.output_tokens / total:.1f} output tok/s")
    print("stage medians (ms): " + " ".join(f"{stage} {value * 1e3:.1f}" for stage, value in medians.items()))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"ttft_s": ttfts, "request_s": totals, "stage_medians_s": medians,
                                        "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens},
                                       indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
