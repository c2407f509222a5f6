"""Streaming under load, and what a client that hangs up leaves behind on the engine replicas."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.serve_processes import wait_until_busy, wait_until_idle

pytestmark = [pytest.mark.slow, pytest.mark.serve]


def test_64_concurrent_streams_complete_with_correct_token_counts(serve_app):
    max_tokens = 12

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str | None, int]:
        stream = await client.chat.completions.create(
            model=serve_app.model, messages=[{"role": "user", "content": f"Tell me about the number {i}."}],
            max_tokens=max_tokens, temperature=0.7, seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        content_chunks, usage, finish, roles = 0, None, None, 0
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                roles += choice.delta.role == "assistant"
                content_chunks += bool(choice.delta.content)
                finish = choice.finish_reason or finish
        return usage.completion_tokens, content_chunks, finish, roles

    async def run() -> list[tuple[int, int, str | None, int]]:
        async with openai.AsyncOpenAI(base_url=f"{serve_app.base_url}/v1", api_key="unused", max_retries=0,
                                      timeout=180, http_client=httpx.AsyncClient(
                                          limits=httpx.Limits(max_connections=64), timeout=180)) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(64))), timeout=300)

    results = asyncio.run(run())
    assert len(results) == 64
    for completion_tokens, content_chunks, finish, roles in results:
        assert completion_tokens == max_tokens and finish == "length" and roles == 1
        assert 1 <= content_chunks <= max_tokens


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Write a very long story."}]}),
    ("/v1/completions", {"prompt": "Once upon a time", "n": 2}),
], ids=["chat", "completion-n2"])
def test_client_disconnect_frees_the_replica(serve_app, path, body):
    assert len(wait_until_idle(serve_app, 30)) == 2
    payload = {"model": serve_app.model, **body, "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as http:
        with http.stream("POST", path, json=payload) as response:
            assert response.status_code == 200
            # Held in a name: a line iterator dropped mid-stream is closed, and closing it closes the connection
            # (httpx), so breaking out of `for line in response.iter_lines()` would hang up right here.
            lines = response.iter_lines()
            events = 0
            for line in lines:
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    assert "error" not in event and all(c["finish_reason"] is None for c in event["choices"]), event
                    events += 1
                if events >= 6:
                    break
            busy = wait_until_busy(serve_app, 30)
            assert sum(s.num_running for s in busy) >= 1 and sum(s.num_used_kv_blocks for s in busy) > 0, busy
    # The connection is closed here, long before 2,000 tokens.
    stats = wait_until_idle(serve_app, 5)
    assert all(s.num_running == 0 and s.num_waiting == 0 for s in stats), stats
    assert all(s.num_used_kv_blocks == 0 and s.num_active_streams == 0 for s in stats), stats


def test_non_streaming_client_that_times_out_frees_the_replica(serve_app):
    payload = {"model": serve_app.model, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
    with httpx.Client(base_url=serve_app.base_url, timeout=3) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=payload)
    stats = wait_until_idle(serve_app, 5)
    assert all(s.num_running == 0 and s.num_used_kv_blocks == 0 for s in stats), stats

