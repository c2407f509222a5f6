"""Tenants on the real app: the session app's ingress is pointed at a tenants file of this module's own (as the
app's `security.tenants_file` would), then back. Prefix caches stay within a tenant, limits answer 429 with
OpenAI's headers, and a tenant flooding the engines past capacity leaves another tenant's first tokens quick."""
from __future__ import annotations

import asyncio
import os
import random
import statistics
import uuid

import httpx
import pytest

from benchmarks.bench_tenants import flood_and_trickle
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


def test_tenant_flooding_past_capacity_leaves_another_tenants_first_tokens_quick(tenants):
    """Engines at 4 batch slots each; the flood keeps 4x that in flight. Under FCFS the trickle would wait behind
    the flood's whole queue, as the flood's own requests do; by fair share it waits for one slot at most."""
    slots = 4
    before = set_engine_max_num_seqs(slots)
    try:
        run = asyncio.run(flood_and_trickle(tenants.base_url, tenants.model, KEYS["flood"], KEYS["trickle"],
                                            4 * slots * len(before), num_trickle=6))
    finally:
        for value in set(before.values()):
            set_engine_max_num_seqs(value)
    alone, trickle, flood = (statistics.median(v) for v in (run.alone_s, run.trickle_s, run.flood_s))
    print(f"trickle TTFT p50 alone {alone:.3f}s, during the flood {trickle:.3f}s; the flood's own {flood:.3f}s")
    assert trickle < flood / 2, (alone, trickle, flood)
    assert trickle <= max(6 * alone, alone + 1.5), (alone, trickle, flood)
