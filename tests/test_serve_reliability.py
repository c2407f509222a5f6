"""What bad days leave behind: a storm of clients that hang up, and requests that outlive their deadline."""
from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter

import httpx
import pytest

from deployments.timeline_config import TimelineArgs
from engine.async_engine import HEAP_TRIM_INTERVAL_S
from tests.serve_processes import (ENGINE, INGRESS, grown_types, object_census, replica_pids, rss_mb,
                                   wait_until_idle)

pytestmark = [pytest.mark.slow, pytest.mark.serve]

STORM_SIZE = 200
REFUSED = "status-503: server_overloaded"
STORM_CONCURRENCY = 40
# Objects of one type a replica may gain over the second half of the storm (100 requests): a per-request leak
# of anything (a request, a tensor, a task, a queue) shows as 100 or more.
MAX_OBJECT_GROWTH = 50
# The ingress keeps recent timelines and routing notes on purpose, in bounded stores (see deployments/timeline*.py).
RETAINED = ("RequestTimeline", "RoutingNote")
# Each engine keeps its last `timeline.step_ring` steps' records for the step trace: a ring that grows with the
# steps a storm takes (more, the faster the engine makes tokens before a client cuts) until it is full.
BOUNDED = {"SchedulerStats": TimelineArgs().step_ring}
# RSS a process may gain over the second half, once the first warmed its allocators up: the engine's
# shape-keyed native caches (oneDNN primitives, bounded) grow by ~0.3-0.6 MB per request early on.
MAX_RSS_GROWTH_MB = 96


async def cut_stream(http: httpx.AsyncClient, model: str, rng: random.Random, i: int) -> str:
    """One streaming request, cut by the client at a random point: before the headers, or after k events."""
    path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": f"Tell story {i}."}]})
                  if i % 2 else ("/v1/completions", {"prompt": f"Story {i}: once upon a time", "n": 1 + i % 3}))
    payload = {"model": model, **body, "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 1.0}
    events_before_cut = rng.choice([0, 1, 2, 5, 10, 30])
    if rng.random() < 0.2:  # hang up before the response even starts
        task = asyncio.create_task(http.post(path, json=payload))
        await asyncio.sleep(rng.uniform(0.0, 0.3))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return "cut-before-headers"
    async with http.stream("POST", path, json=payload) as response:
        if response.status_code != 200:
            await response.aread()
            try:
                detail = response.json()["error"]["code"]
            except (ValueError, KeyError, TypeError):
                detail = response.text[:200]
            return f"status-{response.status_code}: {detail}"
        events = 0
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                assert "error" not in json.loads(line[6:]), line
                events += 1
            if events >= events_before_cut or line == "data: [DONE]":
                break
    return "cut-after-events"


async def storm(base_url: str, model: str, seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(STORM_CONCURRENCY)
    limits = httpx.Limits(max_connections=STORM_CONCURRENCY * 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as http:
        async def one(i: int) -> str:
            async with gate:
                return await cut_stream(http, model, rng, i)

        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(count))), timeout=300)


def ingress_requests_in_progress(serve_app) -> float:
    text = serve_app.scrape_metrics()
    values = [float(v) for v in re.findall(r"^tokenline_http_requests_in_progress\{[^}]*\} (\S+)$", text, re.M)]
    return sum(values)


def test_disconnect_storm_leaves_nothing_running_and_memory_flat(serve_app):
    assert len(wait_until_idle(serve_app, 30)) == 2
    pids = {**replica_pids(ENGINE), **replica_pids(INGRESS)}
    assert len(pids) == 3, pids
    half = STORM_SIZE // 2
    first = asyncio.run(storm(serve_app.base_url, serve_app.model, seed=1, count=half))
    assert len(wait_until_idle(serve_app, 30)) == 2
    time.sleep(HEAP_TRIM_INTERVAL_S + 2)  # an idle engine returns freed heap to the OS within this
    warm = rss_mb(pids)
    objects = {**object_census(ENGINE), **object_census(INGRESS)}
    second = asyncio.run(storm(serve_app.base_url, serve_app.model, seed=2, count=STORM_SIZE - half))
    outcomes = first + second
    # A replica that judges it cannot take one more (its waiting queue, or its predicted finish against the deadline)
    # refuses it with a 503 server_overloaded, by design; nothing else but a cut is allowed. (Once, in a whole run
    # on a machine at half its usual speed, 67 of the 200 got a 503 whose code was not recorded then.)
    refused = outcomes.count(REFUSED)
    assert len(outcomes) == STORM_SIZE and set(outcomes) <= {"cut-before-headers", "cut-after-events", REFUSED}, (
        [o for o in outcomes if not o.startswith("cut-")])
    assert refused <= STORM_SIZE // 2, refused
    assert outcomes.count("cut-before-headers") > 10 and outcomes.count("cut-after-events") > 60, Counter(outcomes)

    stats = wait_until_idle(serve_app, 30)
    assert len(stats) == 2, stats
    time.sleep(HEAP_TRIM_INTERVAL_S + 2)
    for s in stats:
        assert s.num_running == 0 and s.num_waiting == 0, stats
        assert s.num_used_kv_blocks == 0 and s.num_active_streams == 0, stats
    after = rss_mb(pids)
    growth = {replica: after[replica] - warm[replica] for replica in pids}
    assert all(g < MAX_RSS_GROWTH_MB for g in growth.values()), (warm, after)
    for replica, census in {**object_census(ENGINE), **object_census(INGRESS)}.items():
        grown = {k: v for k, v in grown_types(objects[replica], census, MAX_OBJECT_GROWTH).items()
                 if k not in RETAINED and census[k] > BOUNDED.get(k, 0)}
        assert not grown, (replica, grown)
    deadline = time.monotonic() + 15  # the gauge reaches the exporter within a metrics report period
    while ingress_requests_in_progress(serve_app) != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ingress_requests_in_progress(serve_app) == 0
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as http:
        ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


LONG = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True}


def test_request_past_its_deadline_gets_408_and_its_engine_work_stops(serve_app):
    assert len(wait_until_idle(serve_app, 30)) == 2
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as http:
        start = time.monotonic()
        response = http.post("/v1/completions", json=LONG, headers={"X-Request-Timeout": "1.5"})
        elapsed = time.monotonic() - start
    assert response.status_code == 408, response.text
    error = response.json()["error"]
    assert error["code"] == "request_timeout" and error["type"] == "timeout_error" and "1.5s" in error["message"]
    assert elapsed < 30  # cut at the deadline, not after 3,000 tokens
    stats = wait_until_idle(serve_app, 10)
    assert all(s.num_running == 0 and s.num_used_kv_blocks == 0 for s in stats), stats


def test_stream_past_its_deadline_ends_with_an_error_event(serve_app):
    assert len(wait_until_idle(serve_app, 30)) == 2
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True},
                         headers={"X-Request-Timeout": "2"}) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    tokens = [json.loads(line[6:]) for line in lines[:-2]]
    assert tokens and all("choices" in t for t in tokens)  # it streamed until the deadline
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == "request_timeout" and set(error) == {"message", "type", "param", "code"}
    stats = wait_until_idle(serve_app, 10)
    assert all(s.num_running == 0 and s.num_used_kv_blocks == 0 for s in stats), stats

