"""Prefix-aware routing on the real app (2 engine replicas): prompts go where their prefix is cached."""
from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from deployments.routing_policy import PromptProbes
from engine.hashing import hash_block_chain

pytestmark = [pytest.mark.slow, pytest.mark.serve]

BLOCK = 16


def token_ids(seed: int, n: int) -> list[int]:
    return random.Random(seed).choices(range(1000, 40000), k=n)


async def cached_tokens(client: httpx.AsyncClient, serve_app, prompt: list[int]) -> int:
    response = await client.post(f"{serve_app.base_url}/v1/completions",
                                 json={"model": serve_app.model, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def replicas_holding(serve_app, prefix: list[int]) -> set[str]:
    """Engine replicas whose own prefix-cache digest holds every full block of ``prefix``."""
    holders = set()
    stats = serve_app.engine_replica_stats()
    assert len(stats) == 2 and all(s.cached_block_digest for s in stats)
    for s in stats:
        blocks = hash_block_chain(prefix, s.block_size)
        if PromptProbes(blocks).cached_blocks(s.cached_block_digest) == len(blocks):
            holders.add(s.replica_id)
    return holders


def test_requests_sharing_a_long_prefix_land_on_the_replica_holding_it(serve_app):
    prefix = token_ids(501, 24 * BLOCK)

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            await cached_tokens(client, serve_app, prefix + token_ids(502, BLOCK))
            holders = replicas_holding(serve_app, prefix)
            assert len(holders) == 1
            # Past the router's memory of what it routed, only the replicas' reports can bring requests back.
            await asyncio.sleep(serve_app.args.router.routed_memory_s + 0.5)
            return [await cached_tokens(client, serve_app, prefix + token_ids(503 + i, BLOCK)) for i in range(5)]

    before = replicas_holding(serve_app, prefix)
    assert not before
    hits = asyncio.run(asyncio.wait_for(run(), timeout=240))
    assert all(hit >= len(prefix) for hit in hits), hits
    assert len(replicas_holding(serve_app, prefix)) == 1  # nothing was recomputed on the other replica


def test_interleaved_prefixes_each_settle_on_one_replica_and_both_get_work(serve_app):
    prefixes = [token_ids(600 + p, 20 * BLOCK) for p in range(4)]
    finished_before = {s.replica_id: s.num_finished_requests for s in serve_app.engine_replica_stats()}

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=120) as client:
            rounds = []
            for r in range(3):  # each round sends one request per prefix at once
                rounds.append(await asyncio.gather(*(
                    cached_tokens(client, serve_app, prefix + token_ids(700 + 10 * r + p, BLOCK))
                    for p, prefix in enumerate(prefixes))))
            return rounds

    rounds = asyncio.run(asyncio.wait_for(run(), timeout=240))
    for later in rounds[1:]:
        assert all(hit >= 20 * BLOCK for hit in later), rounds
    holders = [replicas_holding(serve_app, prefix) for prefix in prefixes]
    assert all(len(h) == 1 for h in holders), holders
    assert len(set.union(*holders)) == 2, holders
    finished_after = {s.replica_id: s.num_finished_requests for s in serve_app.engine_replica_stats()}
    assert all(finished_after[r] > finished_before.get(r, 0) for r in finished_after)
