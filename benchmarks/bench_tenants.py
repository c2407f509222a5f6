"""One tenant floods past capacity, another sends a trickle: the trickle's time to first token, alone and during
the flood, with fair share (two tenants) and without it (both keys one tenant: first come, first served).

The app starts once with a tenants file of its own (tenants `flood` and `trickle`, and `shared`, whose two keys
are one tenant). Capacity is the engines' batch slots (`--max-num-seqs` x replicas); the flood keeps
`--flood-factor` times that many streams in flight. The trickle sends one short request at a time. Prints the
TTFT percentiles and writes them as JSON.

    python -m benchmarks.bench_tenants --model ~/.cache/tokenline/SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from loadtests.metrics import percentile

log = logging.getLogger("bench_tenants")

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "river", "stone", "cloud", "maple"]
KEYS = {"flood": "sk-bench-flood", "trickle": "sk-bench-trickle", "shared-1": "sk-bench-shared-1",
        "shared-2": "sk-bench-shared-2"}
TENANTS = f"""
tenants:
  - {{name: flood, keys: [{KEYS['flood']}]}}
  - {{name: trickle, keys: [{KEYS['trickle']}]}}
  - {{name: shared, keys: [{KEYS['shared-1']}, {KEYS['shared-2']}]}}
"""


@dataclass
class FloodRun:
    alone_s: list[float]  # the trickle's TTFTs with nothing else running
    trickle_s: list[float]  # ... during the flood
    flood_s: list[float]  # the flood's own TTFTs


async def ttft_s(http: httpx.AsyncClient, model: str, key: str, prompt: str, max_tokens: int) -> float:
    """Seconds from sending a streamed completion to its first token (the rest is read to the end)."""
    started = time.perf_counter()
    first = None
    async with http.stream("POST", "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                                 "ignore_eos": True, "temperature": 0}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first


async def flood_and_trickle(base_url: str, model: str, flood_key: str, trickle_key: str, num_streams: int,
                            num_trickle: int = 6, warmup_s: float = 3.0, flood_tokens: int = 24,
                            trickle_tokens: int = 2, seed: int = 0) -> FloodRun:
    rng = random.Random(seed)

    def fresh_prompt() -> str:  # unique, so the prefix cache shortens nobody's prefill
        return " ".join(rng.choices(WORDS, k=24))

    async with httpx.AsyncClient(base_url=base_url, timeout=300,
                                 limits=httpx.Limits(max_connections=num_streams + 8)) as http:
        alone = [await ttft_s(http, model, trickle_key, fresh_prompt(), trickle_tokens) for _ in range(num_trickle)]
        stop = asyncio.Event()
        flood: list[float] = []

        async def flood_one() -> None:
            while not stop.is_set():
                flood.append(await ttft_s(http, model, flood_key, fresh_prompt(), flood_tokens))

        flooders = [asyncio.create_task(flood_one()) for _ in range(num_streams)]
        try:
            await asyncio.sleep(warmup_s)  # the engines' queues fill
            trickle = []
            for _ in range(num_trickle):
                trickle.append(await ttft_s(http, model, trickle_key, fresh_prompt(), trickle_tokens))
                await asyncio.sleep(0.3)
        finally:
            stop.set()
            await asyncio.gather(*flooders, return_exceptions=True)
    return FloodRun(alone, trickle, flood)


def summary(name: str, run: FloodRun) -> dict:
    alone, trickle = statistics.median(run.alone_s), statistics.median(run.trickle_s)
    return {"mode": name, "trickle_alone_p50_ms": round(alone * 1000, 1),
            "trickle_flood_p50_ms": round(trickle * 1000, 1),
            "trickle_flood_p90_ms": round(percentile(run.trickle_s, 0.9) * 1000, 1),
            "ratio_p50": round(trickle / alone, 2), "flood_p50_ms": round(statistics.median(run.flood_s) * 1000, 1),
            "num_flood_requests": len(run.flood_s), "num_trickle_requests": len(run.trickle_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--flood-factor", type=float, default=4.0)
    parser.add_argument("--trickle", type=int, default=12, help="trickle requests per phase")
    parser.add_argument("--out", default="results/bench_tenants.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise

    from deployments import local
    from deployments.auth import SecurityArgs
    from deployments.config import AppArgs

    tenants_file = Path(tempfile.mkdtemp(prefix="bench-tenants-")) / "tenants.yaml"
    tenants_file.write_text(TENANTS)
    app_args = AppArgs(model=args.model, num_engine_replicas=args.replicas, engine_num_cpus=1,
                       max_num_seqs=args.max_num_seqs, ingress_max_replicas=1,
                       security=SecurityArgs(tenants_file=str(tenants_file)))
    streams = round(args.flood_factor * args.max_num_seqs * args.replicas)
    app = local.start(app_args, num_cpus=args.replicas + 1)
    try:
        rows = []
        for name, flood_key, trickle_key in (("fair share (two tenants)", KEYS["flood"], KEYS["trickle"]),
                                             ("FCFS (one tenant)", KEYS["shared-1"], KEYS["shared-2"])):
            run = asyncio.run(flood_and_trickle(app.base_url, app.model, flood_key, trickle_key, streams,
                                                num_trickle=args.trickle))
            rows.append(summary(name, run))
            log.info("%s", rows[-1])
    finally:
        app.stop()
    print(f"\n{streams} flood streams against {args.replicas} engine replica(s) of {args.max_num_seqs} slots")
    print(f"{'mode':<26} {'alone p50':>10} {'flood p50':>10} {'flood p90':>10} {'ratio':>6} {'flood own p50':>14}")
    for r in rows:
        print(f"{r['mode']:<26} {r['trickle_alone_p50_ms']:>8.0f}ms {r['trickle_flood_p50_ms']:>8.0f}ms "
              f"{r['trickle_flood_p90_ms']:>8.0f}ms {r['ratio_p50']:>6.2f} {r['flood_p50_ms']:>12.0f}ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "flood_streams": streams, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
