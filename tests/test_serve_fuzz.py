"""schemathesis against the app's own /openapi.json: generated requests to every endpoint, valid and not.

No answer may be a 5xx, every error has OpenAI's shape, and the server is healthy and idle afterwards.
`make test` runs TOKENLINE_FUZZ_CASES cases in all (default 240); `make fuzz` runs 1,200.
Each case is kept cheap: generation endpoints get at most 4 new tokens, and a 20 s deadline as a backstop.
"""
from __future__ import annotations

import json
import os
from collections import Counter

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode

from tests.serve_processes import wait_until_idle

pytestmark = [pytest.mark.slow, pytest.mark.serve]

NUM_CASES = int(os.environ.get("TOKENLINE_FUZZ_CASES", "240"))
GENERATES = {"/v1/completions", "/v1/chat/completions"}
MAX_NEW_TOKENS = 4
MAX_ROUNDS = 8
# Profiling changes what the replicas do; its endpoints are fuzzed for their refusals, not run.
SKIP = {("POST", "/start_profile")}


def cheap(body):
    """Caps what a generation costs while leaving the rest of the generated body as it is."""
    if isinstance(body, dict):
        tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        if tokens is None or (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > MAX_NEW_TOKENS):
            body = {**body, "max_tokens": MAX_NEW_TOKENS}
            body.pop("max_completion_tokens", None)
        if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > MAX_NEW_TOKENS:
            body["min_tokens"] = MAX_NEW_TOKENS
    return body


def fuzz(op, mode: GenerationMode, count: int, round_seed: int, session: requests.Session, base_url: str,
         statuses: Counter[int]) -> None:
    @seed(round_seed)
    @settings(max_examples=count, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case) -> None:
        if op.path in GENERATES:
            case.body = cheap(case.body)
        response = case.call(base_url=base_url, session=session, timeout=60, headers={"X-Request-Timeout": "20"})
        statuses[response.status_code] += 1
        assert_openai_error(response, f"{op.method.upper()} {op.path} {mode.value}: {case.body!r:.300}")

    run()


def assert_openai_error(response, what: str) -> None:
    assert response.status_code < 500, f"{what}: {response.status_code} {response.content[:500]!r}"
    if response.status_code >= 400:
        error = json.loads(response.content)["error"]
        assert set(error) == {"message", "type", "param", "code"}, what
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), what


def test_generated_requests_get_no_5xx_and_openai_shaped_errors(serve_app):
    schema = schemathesis.openapi.from_url(f"{serve_app.base_url}/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]
    operations = [op for op in operations if (op.method.upper(), op.path) not in SKIP]
    assert {op.path for op in operations} >= {"/health", "/v1/models", "/v1/completions", "/v1/chat/completions"}
    # Generation endpoints are where input matters most: they take half the cases.
    shares = {op.path: (3 if op.path in GENERATES else 1) for op in operations}
    per_share = NUM_CASES / sum(shares.values())
    statuses: Counter[int] = Counter()
    with requests.Session() as session:
        # Rounds with fresh seeds until the count is reached: small operations (GET /health) run out of new cases.
        for round_seed in range(MAX_ROUNDS):
            before = sum(statuses.values())
            for op in operations:
                for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                    try:
                        fuzz(op, mode, max(1, round(per_share * shares[op.path] / 2)), round_seed, session,
                             serve_app.base_url, statuses)
                    except Unsatisfiable:  # nothing in this operation can be made invalid (no parameters, no body)
                        assert mode == GenerationMode.NEGATIVE, op.path
            if sum(statuses.values()) >= NUM_CASES or sum(statuses.values()) == before:
                break
    print(f"fuzzed {sum(statuses.values())} cases over {len(operations)} operations: {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) >= NUM_CASES, statuses
    assert statuses[200] > 0 and sum(n for s, n in statuses.items() if s >= 400) > 0, statuses
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as http:
        assert http.get("/health").json() == {"status": "ok"}
        ok = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
    stats = wait_until_idle(serve_app, 30)
    assert len(stats) == 2 and all(s.num_running == 0 and s.num_used_kv_blocks == 0 for s in stats), stats
