"""No request can take an engine replica down, on the real app.

The request that once did (`stop_token_ids` past the vocabulary with `min_tokens`), and bad combinations of
fields, each get a 4xx; after each one a normal request is served, and no engine replica restarted. The same
request sent straight to the engine deployment (past the ingress's own check) is refused at the replica's border.
A step made to fail (the engine's test hook) fails its own batch: its requests end with a 500 or an SSE error
event saying the engine step failed, never "retry", and the other replica's requests stream on.
"""
from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import pytest

from deployments.records import EngineRequest, RequestRejected
from engine import SamplingParams
from tests.serve_processes import ENGINE, inject_step_fault, replica_actors, replica_pids, wait_until_idle

pytestmark = [pytest.mark.slow, pytest.mark.serve]

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
THE_REQUEST = {"prompt": "hi", "max_tokens": 4, "min_tokens": 1, "stop_token_ids": [99999999]}
VOCAB = 49152  # SmolLM2
TOO_LONG_TEXT = "a" * 700_000  # past 8,192 tokens of at most 81 characters each: refused before tokenizing

BAD = [
    pytest.param(COMPLETIONS, THE_REQUEST, id="stop-id-past-vocab-with-min-tokens"),
    pytest.param(COMPLETIONS, {**THE_REQUEST, "stream": True}, id="same-streamed"),
    pytest.param(CHAT, {"messages": HI, "max_tokens": 4, "min_tokens": 1, "stop_token_ids": [99999999]},
                 id="same-chat"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "stop_token_ids": [VOCAB], "min_tokens": 2}, id="stop-id-at-vocab"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "stop_token_ids": [-1], "min_tokens": 1, "max_tokens": 3},
                 id="negative-stop-id"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "stop_token_ids": [2**63], "ignore_eos": True}, id="stop-id-2^63"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "stop_token_ids": [2] * 65, "min_tokens": 1}, id="65-stop-ids"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "stop_token_ids": "2", "min_tokens": 1}, id="stop-ids-not-a-list"),
    pytest.param(COMPLETIONS, {"prompt": [VOCAB], "max_tokens": 2}, id="prompt-id-at-vocab"),
    pytest.param(COMPLETIONS, {"prompt": [1, 2**40], "echo": True, "max_tokens": 2}, id="echo-of-an-unknown-id"),
    pytest.param(COMPLETIONS, {"prompt": [[5, -3]], "n": 2}, id="batched-negative-id"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "n": 16, "max_tokens": 2000}, id="n-times-max-tokens-past-kv"),
    pytest.param(CHAT, {"messages": HI, "n": 4, "seed": -1, "max_tokens": 4000}, id="chat-n-times-max-tokens"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "n": 17, "max_tokens": 1}, id="n-17"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "n": 0, "seed": 2**70}, id="n-0-huge-seed"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "min_tokens": 5, "max_tokens": 4, "ignore_eos": True},
                 id="min-over-max"),
    pytest.param(CHAT, {"messages": HI, "min_tokens": 3, "max_completion_tokens": 2, "max_tokens": 9},
                 id="min-over-max-completion-tokens"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "top_k": -2, "temperature": 0.5, "seed": 3}, id="top-k-minus-2"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "top_p": 1.5, "seed": 3, "n": 2}, id="top-p-1.5"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "top_p": 0, "temperature": 0}, id="top-p-0-greedy"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "top_p": math.nan, "top_k": 5}, id="top-p-nan"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "min_p": math.inf, "top_k": 5}, id="min-p-inf"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "min_p": 1.5, "min_tokens": 1}, id="min-p-1.5"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "logprobs": 21, "n": 2}, id="logprobs-21"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "logprobs": -1, "stream": True}, id="logprobs-negative-streamed"),
    pytest.param(CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 21, "n": 3}, id="top-logprobs-21"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "stop": ["x" * 257], "stop_token_ids": [2]}, id="stop-257-chars"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "stop": ["a"] * 9, "min_tokens": 1}, id="9-stop-strings"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "max_tokens": 8192, "n": 2}, id="max-tokens-past-context"),
    pytest.param(COMPLETIONS, {"prompt": [5] * 8192, "max_tokens": 1}, id="prompt-fills-context"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "max_tokens": 7000, "stream": True}, id="max-tokens-past-kv"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "max_tokens": -5, "min_tokens": -1}, id="negative-sizes"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "max_tokens": 10**30, "n": 16}, id="max-tokens-10^30-n-16"),
    pytest.param(CHAT, {"messages": HI, "max_completion_tokens": 0, "max_tokens": 4}, id="max-completion-0"),
    pytest.param(CHAT, {"messages": HI, "temperature": -0.1, "seed": 2**70}, id="negative-temperature"),
    pytest.param(COMPLETIONS, {"prompt": TOO_LONG_TEXT, "max_tokens": 1}, id="text-far-past-context"),
    pytest.param(CHAT, {"messages": [{"role": "user", "content": TOO_LONG_TEXT}]}, id="chat-far-past-context"),
]


# The router settles on its replicas' reports within a few report periods (1 s each) after a burst of cancelled
# requests: idle traffic reaches every replica again within this.
SETTLE_S = 8.0


def replicas_answering(http: httpx.Client, served_by: set[str], pids: dict, timeout_s: float = SETTLE_S) -> set[str]:
    """Normal requests until every engine replica has answered one (bounded): a replica that stopped serving
    never does."""
    deadline = time.monotonic() + timeout_s
    i = 0
    while served_by != set(pids) and time.monotonic() < deadline:
        served_by = served_by | {normal_request(http, 1000 + i)}
        i += 1
        time.sleep(0.1)
    return served_by


def normal_request(http: httpx.Client, i: int) -> str:
    """A small request that must succeed; returns the engine replica that served it (from its timeline)."""
    response = http.post(COMPLETIONS, json={"prompt": f"Normal request {i}:", "max_tokens": 2},
                         headers={"X-Tokenline-Timeline": "1"})
    assert response.status_code == 200, response.text
    return response.json()["timeline"]["replica_id"]


def test_bad_combinations_get_4xx_and_every_replica_keeps_serving(serve_app):
    assert len(BAD) >= 31
    assert len(wait_until_idle(serve_app, 60)) == 2
    pids = replica_pids(ENGINE)
    assert len(pids) == 2
    served_by = set()
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as http:
        assert replicas_answering(http, set(), pids) == set(pids)
        for i, case in enumerate(BAD):
            path, body = case.values
            # json.dumps writes NaN and Infinity, as some clients do (httpx's own encoder refuses them).
            response = http.post(path, content=json.dumps({"model": serve_app.model, **body}),
                                 headers={"content-type": "application/json"})
            assert 400 <= response.status_code < 500, (case.id, response.status_code, response.text[:300])
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], (case.id, error)
            served_by.add(normal_request(http, i))
        served_by = replicas_answering(http, served_by, pids)
    # Both replicas answer after the bad requests (if not: what each reported, to tell a stuck one from routing).
    assert served_by == set(pids), [(s.replica_id, s.num_running, s.num_waiting, s.num_used_kv_blocks,
                                     s.num_active_streams) for s in serve_app.engine_replica_stats()]
    assert replica_pids(ENGINE) == pids  # same replicas, same processes: none restarted


def test_the_request_sent_past_the_ingress_is_refused_at_each_replica_border(serve_app):
    from ray import serve

    pids = replica_pids(ENGINE)
    handle = serve.get_deployment_handle(ENGINE, "tokenline").options(stream=True)
    params = SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=[99999999])

    async def send(i: int):
        stream = handle.generate.remote(EngineRequest(f"direct-{i}", [28, 29, 30], params))
        return [message async for message in stream]

    async def main():
        return await asyncio.gather(*(send(i) for i in range(8)))

    for messages in asyncio.run(main()):
        [refusal] = messages
        assert isinstance(refusal, RequestRejected) and refusal.status == 400
        assert refusal.code == "invalid_token_id" and refusal.param == "stop_token_ids"
    stats = serve_app.engine_replica_stats()
    assert {s.replica_id for s in stats} == set(pids) and replica_pids(ENGINE) == pids


MARK = [4040, 4041, 4042, 4043]  # the prompt prefix the step fault is armed for


async def stream_outcome(http: httpx.AsyncClient, i: int) -> str:
    """complete, or error-event:CODE for a stream that ended with an SSE error event."""
    body = {"prompt": f"Stream {i}: once upon a time", "max_tokens": 64, "ignore_eos": True, "stream": True}
    async with http.stream("POST", COMPLETIONS, json=body) as response:
        assert response.status_code == 200
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    if "error" in last:
        error = last["error"]
        assert set(error) == {"message", "type", "param", "code"} and "retry" not in error["message"]
        return f"error-event:{error['code']}"
    return "complete"


async def streams_and_a_faulted_request(base_url: str, count: int) -> tuple[list[str], httpx.Response]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120,
                                 limits=httpx.Limits(max_connections=count + 4)) as http:
        streams = [asyncio.create_task(stream_outcome(http, i)) for i in range(count)]
        await asyncio.sleep(1.0)  # the streams are decoding on both replicas
        faulted = await http.post(COMPLETIONS, json={"prompt": MARK + [28] * 12, "max_tokens": 8})
        return await asyncio.wait_for(asyncio.gather(*streams), 150), faulted


def test_step_made_to_fail_fails_its_batch_only_and_the_other_requests_stream_on(serve_app):
    assert len(wait_until_idle(serve_app, 60)) == 2
    pids = replica_pids(ENGINE)
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as http:
        assert replicas_answering(http, set(), pids) == set(pids)  # the router sees both as idle
    inject_step_fault(MARK)
    try:
        outcomes, faulted = asyncio.run(streams_and_a_faulted_request(serve_app.base_url, 8))
    finally:
        inject_step_fault(None)
    assert faulted.status_code == 500 and "retry-after" not in faulted.headers, faulted.text
    error = faulted.json()["error"]
    assert error["code"] == "engine_step_failed" and error["type"] == "internal_error"
    # Streams in the faulted step's batch end with its error; the other replica's complete.
    assert set(outcomes) <= {"complete", "error-event:engine_step_failed"}, outcomes
    assert outcomes.count("complete") >= 1, outcomes
    stats = wait_until_idle(serve_app, 60)
    assert all(s.num_running == 0 and s.num_used_kv_blocks == 0 for s in stats), stats
    assert replica_pids(ENGINE) == pids and len(replica_actors(ENGINE)) == 2
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as http:
        assert len({normal_request(http, i) for i in range(8)}) >= 1
