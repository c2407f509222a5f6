"""Tenants on the real app: the session app's ingress is pointed at a tenants file of this module's own (as the
app's `security.tenants_file` would), then back. Prefix caches stay within a tenant, limits answer 429 with
OpenAI's headers, and a tenant flooding the engines past capacity leaves another tenant's first tokens quick."""
from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from deployments.auth import SecurityArgs
from tests.serve_processes import configure_ingress_security, set_engine_max_num_seqs

pytestmark = [pytest.mark.slow, pytest.mark.serve]

RUN = uuid.uuid4().hex[:8]  # limits are kept by tenant name in the ingress: names of this run only
KEYS = {name: f"sk-{name}-{RUN}" for name in ("iso-a", "iso-b", "rpm", "tpm", "conc", "flood", "trickle")}
TENANTS = f"""
tenants:
  - {{name: iso-a-{RUN}, keys: [{KEYS['iso-a']}]}}
  - {{name: iso-b-{RUN}, keys: [{KEYS['iso-b']}]}}
  - {{name: rpm-{RUN}, keys: [{KEYS['rpm']}], limits: {{requests_per_minute: 3}}}}
  - {{name: tpm-{RUN}, keys: [{KEYS['tpm']}], limits: {{tokens_per_minute: 400}}}}
  - {{name: conc-{RUN}, keys: [{KEYS['conc']}], limits: {{max_concurrent_requests: 1}}}}
  - {{name: flood-{RUN}, keys: [{KEYS['flood']}]}}
  - {{name: trickle-{RUN}, keys: [{KEYS['trickle']}]}}
"""


@pytest.fixture(scope="module")
def tenants(serve_app, tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    fresh = path.with_name("tenants.yaml.new")
    fresh.write_text(TENANTS)
    os.replace(fresh, path)
    configure_ingress_security(SecurityArgs(tenants_file=str(path)))
    try:
        yield serve_app
    finally:
        configure_ingress_security(serve_app.args.security)


def headers(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def completion(http: httpx.Client, app, tenant: str, prompt: str, max_tokens: int = 1, **extra) -> httpx.Response:
    return http.post("/v1/completions", headers=headers(tenant),
                     json={"model": app.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})


def cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_same_prompt_from_another_tenant_gets_no_cached_tokens_and_from_the_same_tenant_does(tenants):
    words = random.Random(RUN).choices(["river", "stone", "cloud", "maple", "harbor", "copper", "violet"], k=120)
    prompt = " ".join(words)
    with httpx.Client(base_url=tenants.base_url, timeout=120) as http:
        assert cached(completion(http, tenants, "iso-a", prompt)) == 0
        assert cached(completion(http, tenants, "iso-b", prompt)) == 0
        assert cached(completion(http, tenants, "iso-a", prompt)) > 0
        assert cached(completion(http, tenants, "iso-a", prompt, cache_salt="other")) == 0  # vLLM's field
        assert cached(completion(http, tenants, "iso-a", prompt, cache_salt="other")) > 0


def assert_429(response: httpx.Response, kind: str | None) -> None:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "rate_limit_exceeded"
    assert int(response.headers["retry-after"]) >= 1
    if kind is not None:
        assert response.headers[f"x-ratelimit-remaining-{kind}"] is not None
        assert response.headers[f"x-ratelimit-limit-{kind}"].isdigit()
        assert response.headers[f"x-ratelimit-reset-{kind}"]


def test_requests_and_tokens_per_minute_refuse_past_the_limit_with_openai_headers(tenants):
    with httpx.Client(base_url=tenants.base_url, timeout=120) as http:
        for i in range(3):
            ok = completion(http, tenants, "rpm", f"hello {i}")
            assert ok.status_code == 200, ok.text
            assert ok.headers["x-ratelimit-limit-requests"] == "3"
            assert ok.headers["x-ratelimit-remaining-requests"] == str(2 - i)
        assert_429(completion(http, tenants, "rpm", "hello again"), "requests")
        assert completion(http, tenants, "iso-a", "hello").status_code == 200  # other tenants are not limited

        ok = completion(http, tenants, "tpm", "hello", max_tokens=150)
        assert ok.status_code == 200, ok.text
        assert int(ok.headers["x-ratelimit-remaining-tokens"]) < 400 - 100  # less what refilled meanwhile
        assert_429(completion(http, tenants, "tpm", "hello", max_tokens=300), "tokens")
        ok = completion(http, tenants, "tpm", "hello", max_tokens=50)  # what is left still passes
        assert ok.status_code == 200, ok.text


def test_concurrent_requests_past_the_limit_get_429_and_pass_once_the_first_ends(tenants):
    async def run() -> None:
        async with httpx.AsyncClient(base_url=tenants.base_url, timeout=120) as http:
            body = {"model": tenants.model, "prompt": "count slowly", "max_tokens": 48, "ignore_eos": True}
            first = asyncio.create_task(http.post("/v1/completions", headers=headers("conc"), json=body))
            for _ in range(100):  # until the first is in flight at the ingress
                await asyncio.sleep(0.05)
                second = await http.post("/v1/completions", headers=headers("conc"),
                                         json={**body, "max_tokens": 1})
                if second.status_code == 429 or first.done():
                    break
            assert not first.done(), "the first request ended before a second could overlap it"
            assert_429(second, None)
            assert (await first).status_code == 200
            again = await http.post("/v1/completions", headers=headers("conc"), json={**body, "max_tokens": 1})
            assert again.status_code == 200, again.text
    asyncio.run(run())


async def ttft_s(http: httpx.AsyncClient, app, tenant: str, prompt: str, max_tokens: int) -> float:
    started = time.perf_counter()
    first = None
    async with http.stream("POST", "/v1/completions", headers=headers(tenant),
                           json={"model": app.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                                 "ignore_eos": True, "temperature": 0}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                first = time.perf_counter() - started
    assert first is not None
    return first


def test_tenant_flooding_past_capacity_leaves_another_tenants_first_tokens_quick(tenants):
    """Engines at 4 batch slots each; the flood keeps 4x that in flight. Under FCFS the trickle would wait behind
    the flood's whole queue, as the flood's own requests do; by fair share it waits for one slot."""
    slots = 4
    before = set_engine_max_num_seqs(slots)
    try:
        flood_ttfts, trickle_ttfts, alone = asyncio.run(_flood_and_trickle(tenants, 4 * slots * len(before)))
    finally:
        for value in set(before.values()):
            set_engine_max_num_seqs(value)
    alone_p50, trickle_p50 = statistics.median(alone), statistics.median(trickle_ttfts)
    flood_p50 = statistics.median(flood_ttfts)
    print(f"trickle TTFT p50 alone {alone_p50:.3f}s, during the flood {trickle_p50:.3f}s; flood {flood_p50:.3f}s")
    assert trickle_p50 < flood_p50 / 2, (alone_p50, trickle_p50, flood_p50)
    assert trickle_p50 <= max(6 * alone_p50, alone_p50 + 1.5), (alone_p50, trickle_p50, flood_p50)


async def _flood_and_trickle(app, num_streams: int) -> tuple[list[float], list[float], list[float]]:
    rng = random.Random(RUN)

    def fresh_prompt() -> str:  # unique, so the prefix cache does not shorten anyone's prefill
        return " ".join(rng.choices(["alpha", "beta", "gamma", "delta", "omega", "sigma"], k=24))

    async with httpx.AsyncClient(base_url=app.base_url, timeout=120,
                                 limits=httpx.Limits(max_connections=num_streams + 8)) as http:
        alone = [await ttft_s(http, app, "trickle", fresh_prompt(), 2) for _ in range(5)]
        stop = asyncio.Event()
        flood_ttfts: list[float] = []

        async def flood() -> None:
            while not stop.is_set():
                flood_ttfts.append(await ttft_s(http, app, "flood", fresh_prompt(), 24))

        flooders = [asyncio.create_task(flood()) for _ in range(num_streams)]
        try:
            await asyncio.sleep(3.0)  # queues build up
            trickle = []
            for _ in range(6):
                trickle.append(await ttft_s(http, app, "trickle", fresh_prompt(), 2))
                await asyncio.sleep(0.3)
        finally:
            stop.set()
            await asyncio.gather(*flooders)
    return flood_ttfts, trickle, alone
