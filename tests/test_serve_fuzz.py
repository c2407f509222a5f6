"""schemathesis against the app's own /openapi.json: generated requests to every endpoint, valid and not.

No answer may be a 5xx, every error has OpenAI's shape, and the server is healthy and idle afterwards.
Generation bodies also get several sampling fields at once, each at an edge (past the vocabulary, past a bound,
a huge seed...): faults that need two fields together, like `stop_token_ids` past the vocabulary with
`min_tokens`, hide from one field at a time.
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
from hypothesis import strategies as st
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
VOCAB = 49152  # SmolLM2
EDGES = {
    "stop_token_ids": [[99999999], [-1], [0], [2], [VOCAB - 1], [VOCAB], [2] * 65, [], [2**63]],
    "min_tokens": [0, 1, 4, -1, 10**9],
    "max_tokens": [1, 4, 0, -1],
    "seed": [0, -1, 2**63 - 1, 2**63, 2**70, -(2**70)],
    "n": [1, 2, 16, 17, 0],
    "temperature": [0, 1e-7, 0.7, 2, 2.5, -1],
    "top_p": [1e-9, 0.5, 1, 0, 1.5],
    "top_k": [-2, -1, 0, 1, VOCAB, 10**9],
    "min_p": [0, 0.5, 1, 1.5],
    "ignore_eos": [True, False],
    "stop": ["x", ["\n", "the"], ["a"] * 9, ["y" * 300], [""]],
    "skip_special_tokens": [False],
    "stream": [True, False],
}
ENDPOINT_EDGES = {
    "/v1/completions": {"logprobs": [0, 5, 20, 21, -1], "echo": [True, False],
                        "prompt": ["hi", [1, 2, 3], [VOCAB], [-1], [[5, 6]], ["a", "b"]]},
    "/v1/chat/completions": {"logprobs": [True, False], "top_logprobs": [0, 5, 20, 21],
                             "max_completion_tokens": [1, 4, 0]},
}


def combined_fields(path: str):
    """Nothing (the generated body as it is), or two to six sampling fields at once, each at one of its edges."""
    if path not in GENERATES:
        return st.just({})
    edges = {**EDGES, **ENDPOINT_EDGES[path]}
    combos = st.lists(st.sampled_from(sorted(edges)), min_size=2, max_size=6, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: st.sampled_from(edges[name]) for name in names}))
    return st.one_of(st.just({}), combos)


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
    @given(case=op.as_strategy(generation_mode=mode), fields=combined_fields(op.path))
    def run(case, fields) -> None:
        if op.path in GENERATES:
            case.body = cheap({**case.body, **fields} if isinstance(case.body, dict) else case.body)
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
