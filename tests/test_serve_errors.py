"""Bad input gets its status and an OpenAI-shaped error body, never a 500, and the server keeps serving."""
from __future__ import annotations

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.serve]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(serve_app) -> httpx.Client:
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as c:
        yield c


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else error["type"])
    if param is not None:
        assert error["param"] == param, error
    return error


BAD_BODIES = [
    pytest.param(CHAT, {"messages": HI, "max_tokens": 0}, "max_tokens", id="max_tokens-zero"),
    pytest.param(CHAT, {"messages": HI, "temperature": -1}, "temperature", id="negative-temperature"),
    pytest.param(CHAT, {"messages": HI, "top_p": 0}, "top_p", id="top_p-zero"),
    pytest.param(CHAT, {"messages": HI, "n": 0}, "n", id="n-zero"),
    pytest.param(CHAT, {"messages": HI, "top_k": -5}, "top_k", id="top_k-negative"),
    pytest.param(CHAT, {"messages": HI, "min_tokens": 9, "max_tokens": 4}, "min_tokens", id="min-over-max"),
    pytest.param(CHAT, {"messages": HI, "top_logprobs": 3}, "top_logprobs", id="top_logprobs-without-logprobs"),
    pytest.param(CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 99}, "top_logprobs", id="top_logprobs-99"),
    pytest.param(CHAT, {"messages": HI, "stop": ["a"] * 9}, "stop", id="too-many-stops"),
    pytest.param(CHAT, {"messages": HI, "presence_penalty": 0.5}, "presence_penalty", id="presence_penalty"),
    pytest.param(CHAT, {"messages": HI, "tools": [{"type": "function"}]}, "tools", id="tools"),
    pytest.param(CHAT, {"messages": HI, "stream_options": {"include_usage": True}}, "stream_options",
                 id="stream_options-without-stream"),
    pytest.param(CHAT, {"messages": []}, "messages", id="no-messages"),
    pytest.param(CHAT, {}, "messages", id="missing-messages"),
    pytest.param(CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages", id="unknown-role"),
    pytest.param(CHAT, {"messages": "hello"}, "messages", id="messages-not-a-list"),
    pytest.param(CHAT, {"messages": HI, "max_tokens": "many"}, "max_tokens", id="max_tokens-not-int"),
    pytest.param(COMPLETIONS, {"prompt": ""}, "prompt", id="empty-prompt"),
    pytest.param(COMPLETIONS, {"prompt": []}, "prompt", id="empty-token-prompt"),
    pytest.param(COMPLETIONS, {"prompt": [1, 2, 10_000_000]}, "prompt", id="token-id-out-of-vocab"),
    pytest.param(COMPLETIONS, {"prompt": [1, -2]}, "prompt", id="negative-token-id"),
    pytest.param(COMPLETIONS, {"prompt": ["a", "b"]}, "prompt", id="batched-prompts"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "logprobs": 50}, "logprobs", id="logprobs-50"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "echo": True, "logprobs": 1}, "echo", id="echo-with-logprobs"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "suffix": "x"}, "suffix", id="suffix"),
    pytest.param(COMPLETIONS, {}, "prompt", id="missing-prompt"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path,body,param", BAD_BODIES)
def test_invalid_parameters_get_400(http, serve_app, path, body, param, stream):
    response = http.post(path, json={"model": serve_app.model, **body, "stream": stream} if "stream_options" not
                         in body else {"model": serve_app.model, **body})
    assert_openai_error(response, 400, param)


def test_unknown_model_gets_404(http):
    error = assert_openai_error(http.post(CHAT, json={"model": "gpt-17", "messages": HI}), 404, "model")
    assert error["code"] == "model_not_found" and "gpt-17" in error["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_prompt_that_does_not_fit_names_its_sizes(http, serve_app, stream):
    prompt = [28] * 9000
    response = http.post(COMPLETIONS, json={"model": serve_app.model, "prompt": prompt, "max_tokens": 16,
                                            "stream": stream})
    error = assert_openai_error(response, 400)
    assert error["code"] == "context_length_exceeded"
    assert "8192" in error["message"] and "9000" in error["message"] and "16" in error["message"]


def test_max_tokens_beyond_the_context_gets_400(http, serve_app):
    error = assert_openai_error(http.post(CHAT, json={"model": serve_app.model, "messages": HI,
                                                      "max_tokens": 100_000}), 400, "max_tokens")
    assert "100000" in error["message"].replace(",", "")


def test_request_beyond_the_replica_kv_pool_is_refused_by_the_engine(http, serve_app):
    # Fits the model's 8,192-token context but not the test replicas' 384 blocks of 16 tokens.
    error = assert_openai_error(http.post(COMPLETIONS, json={"model": serve_app.model, "prompt": "hi",
                                                             "max_tokens": 7000}), 400, "max_tokens")
    assert "KV blocks" in error["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"null"], ids=["broken", "empty", "list", "null"])
def test_malformed_json_gets_400(http, raw):
    response = http.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(response, 400)


def test_unknown_route_gets_openai_shaped_404(http):
    assert_openai_error(http.get("/v1/engines"), 404)


def test_server_keeps_serving_after_bad_input(http, serve_app):
    for body in ({"messages": HI, "max_tokens": -1}, {"messages": None}, {"prompt": [10**12]}):
        assert http.post(CHAT, json=body).status_code in (400, 404)
    ok = http.post(CHAT, json={"model": serve_app.model, "messages": HI, "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
    assert all(stats.num_running == 0 for stats in serve_app.engine_replica_stats())
