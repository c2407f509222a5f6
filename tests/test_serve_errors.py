"""Bad input gets its status and an OpenAI-shaped error body, never a 500, and the server keeps serving."""
from __future__ import annotations

import json

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
    pytest.param(CHAT, {"messages": HI, "presence_penalty": 2.5}, "presence_penalty", id="presence_penalty-2.5"),
    pytest.param(CHAT, {"messages": HI, "repetition_penalty": 0}, "repetition_penalty", id="repetition_penalty-0"),
    pytest.param(CHAT, {"messages": HI, "logit_bias": {"99999999": 1}}, "logit_bias", id="logit_bias-out-of-vocab"),
    pytest.param(CHAT, {"messages": HI, "logit_bias": {"x": 1}}, "logit_bias", id="logit_bias-not-a-token"),
    pytest.param(CHAT, {"messages": HI, "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias",
                 id="logit_bias-301"),
    pytest.param(CHAT, {"messages": HI, "tools": [{"type": "function"}]}, "tools", id="tools-without-function"),
    pytest.param(CHAT, {"messages": HI, "tool_choice": "required"}, "tool_choice", id="tool_choice-without-tools"),
    pytest.param(CHAT, {"messages": HI, "functions": [{"name": "f"}]}, "functions", id="legacy-functions"),
    pytest.param(CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}],
                        "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice",
                 id="tool_choice-unknown-function"),
    pytest.param(CHAT, {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strange"}}}}, "response_format", id="invalid-json-schema"),
    pytest.param(CHAT, {"messages": HI, "response_format": {"type": "json_object"}, "guided_regex": "a+"},
                 "guided_regex", id="two-structured-outputs"),
    pytest.param(CHAT, {"messages": HI, "guided_regex": "(unclosed"}, "response_format", id="invalid-regex"),
    pytest.param(CHAT, {"messages": HI, "guided_choice": []}, "response_format", id="no-choices"),
    pytest.param(CHAT, {"messages": HI, "guided_json": {"type": "object"}, "min_tokens": 2}, "min_tokens",
                 id="min_tokens-with-structured-output"),
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
    pytest.param(COMPLETIONS, {"prompt": ["a"] * 33}, "prompt", id="33-prompts"),
    pytest.param(COMPLETIONS, {"prompt": ["a", ""]}, "prompt", id="batch-with-an-empty-prompt"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "logprobs": 50}, "logprobs", id="logprobs-50"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "suffix": "x"}, "suffix", id="suffix"),
    pytest.param(COMPLETIONS, {}, "prompt", id="missing-prompt"),
    pytest.param(CHAT, {"messages": HI, "max_tokens": 10**30}, "max_tokens", id="max_tokens-10e30"),
    pytest.param(CHAT, {"messages": HI, "n": 10**9}, "n", id="n-huge"),
    pytest.param(CHAT, {"messages": HI, "stop": [f"stop{i}" for i in range(300)]}, "stop", id="300-stops"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "logprobs": -1}, "logprobs", id="logprobs-negative"),
    pytest.param(CHAT, {"messages": HI, "logprobs": True, "top_logprobs": -1}, "top_logprobs",
                 id="top_logprobs-negative"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "min_tokens": 10**12}, "min_tokens",
                 id="min_tokens-huge"),
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


def test_body_over_the_limit_gets_413(http, serve_app):
    limit = serve_app.args.limits.max_body_bytes
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * limit + b'"}]}'
    error = assert_openai_error(http.post(CHAT, content=big, headers={"content-type": "application/json"}), 413)
    assert f"{limit:,}" in error["message"]

    def chunked():  # no Content-Length: the limit is counted as the body arrives
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(limit // (1 << 20) + 1):
            yield b"a" * (1 << 20)
        yield b'"}]}'

    assert_openai_error(http.post(CHAT, content=chunked(), headers={"content-type": "application/json"}), 413)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          "application/xml"])
def test_body_that_is_not_json_gets_415(http, serve_app, content_type):
    body = json.dumps({"model": serve_app.model, "messages": HI, "max_tokens": 2})
    error = assert_openai_error(http.post(CHAT, content=body, headers={"content-type": content_type}), 415)
    assert content_type in error["message"]


@pytest.mark.parametrize("raw", [b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
                                 b"[" * 100_000 + b"]" * 100_000],
                         ids=["invalid-utf8", "nested-100k-deep"])
def test_undecodable_json_gets_400(http, raw):
    assert_openai_error(http.post(CHAT, content=raw, headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize("path,raw,param", [
    (CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}', "messages"),
    (COMPLETIONS, b'{"prompt": "a\\udfffb", "max_tokens": 2}', "prompt"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\udc00"], "max_tokens": 2}', "stop"),
], ids=["chat", "completion", "stop"])
def test_lone_surrogate_gets_400(http, path, raw, param):
    assert_openai_error(http.post(path, content=raw, headers={"content-type": "application/json"}), 400, param)


def test_seeds_are_opaque_integers_of_any_size(http, serve_app):
    """OpenAI's seeds are opaque: one past 64 bits wraps into the engine's range, and so does seed + choice.
    Each call salts its prefix cache apart, so that both compute the same steps: where the CPU has AMX, a prompt
    read from the cache would leave a step of one token on the native linear kernel instead of oneDNN's, and bf16
    logits would differ in their last bits (README: native_linear_max_rows)."""
    salts = iter(range(100))

    def texts(seed: int) -> list[str]:
        response = http.post(CHAT, json={"model": serve_app.model, "messages": HI, "max_tokens": 4, "seed": seed,
                                         "n": 2, "temperature": 1.0, "cache_salt": f"seeds-{next(salts)}"})
        assert response.status_code == 200, response.text
        return [c["message"]["content"] for c in response.json()["choices"]]

    assert texts(2**70) == texts(2**70)  # still reproducible
    for seed in (-(2**70), 2**64 - 1, 2**63 - 1):
        texts(seed)


def test_unicode_control_characters_and_unknown_fields_are_served(http, serve_app):
    text = "\x00\x01\x07\x1b[31m\u202e\ufeff\u200b 日本語 🤖 e\u0301 \U0010ffff"
    for path, body in ((CHAT, {"messages": [{"role": "user", "content": text}], "stop": ["\x00", "🤖"]}),
                       (COMPLETIONS, {"prompt": text, "echo": True})):
        response = http.post(path, json={"model": serve_app.model, **body, "max_tokens": 3, "frobnicate": {"x": [1]},
                                         "metadata": {"k": "v"}})
        assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"].startswith(text)  # echoed back intact


@pytest.mark.parametrize("path,body", [
    (COMPLETIONS, {"prompt": "a" * 700_000}),
    (CHAT, {"messages": [{"role": "system", "content": "b" * 400_000}, {"role": "user", "content": "c" * 300_000}]}),
], ids=["completion", "chat"])
def test_text_far_beyond_the_context_is_refused_before_tokenizing(http, serve_app, path, body):
    error = assert_openai_error(http.post(path, json={"model": serve_app.model, **body, "max_tokens": 1}), 400)
    assert error["code"] == "context_length_exceeded" and "characters" in error["message"]


@pytest.mark.parametrize("value", ["soon", "-1", "0", "inf", "nan"])
def test_bad_request_timeout_header_gets_400(http, serve_app, value):
    response = http.post(CHAT, json={"model": serve_app.model, "messages": HI, "max_tokens": 2},
                         headers={"X-Request-Timeout": value})
    assert_openai_error(response, 400, "X-Request-Timeout")
