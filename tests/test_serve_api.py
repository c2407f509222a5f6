"""The API real clients use, with the official client against the real app: structured outputs, tools,
logit_bias and penalties, batched completion prompts, echo with logprobs, and the small endpoints."""
from __future__ import annotations

import asyncio
import json
from enum import Enum
from typing import Annotated, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = [pytest.mark.slow, pytest.mark.serve]

NUM_PROMPTS = 20
CONCURRENCY = 16


class Address(BaseModel):
    city: str = Field(max_length=20)
    zip_code: int = Field(ge=0, le=99999)


class Person(BaseModel):  # nested objects
    name: str = Field(max_length=20)
    address: Address


class Size(str, Enum):
    small = "S"
    medium = "M"
    large = "L"


class Product(BaseModel):  # enums
    colour: Literal["red", "green", "blue"]
    size: Size
    in_stock: bool


class Review(BaseModel):  # arrays with bounds
    tags: list[Annotated[str, Field(max_length=16)]] = Field(min_length=1, max_length=3)
    scores: list[Annotated[int, Field(ge=1, le=5)]] = Field(max_length=4)


SCHEMAS = {Person: "Describe a person who lives in city number {i}.",
           Product: "Describe product number {i} from our shop.",
           Review: "Review restaurant number {i} with a few tags and scores."}

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
    "required": ["timezone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def client(serve_app) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{serve_app.base_url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def test_parse_returns_a_parsed_object_for_every_prompt_schema_and_temperature(serve_app):
    async def one(c, limit, schema, prompt, temperature, seed):
        async with limit:
            r = await c.chat.completions.parse(model=serve_app.model, response_format=schema, max_tokens=96,
                                               messages=[{"role": "user", "content": prompt}],
                                               temperature=temperature, seed=seed)
            return schema, r.choices[0]

    async def run():
        limit = asyncio.Semaphore(CONCURRENCY)
        async with openai.AsyncOpenAI(base_url=f"{serve_app.base_url}/v1", api_key="unused", max_retries=0,
                                      timeout=300) as c:
            return await asyncio.gather(*[one(c, limit, schema, prompt.format(i=i), temperature, i)
                                          for schema, prompt in SCHEMAS.items() for i in range(NUM_PROMPTS)
                                          for temperature in (0.0, 1.0)])

    results = asyncio.run(run())
    assert len(results) == 3 * NUM_PROMPTS * 2
    for schema, choice in results:
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, schema)
    reviews = [c.message.parsed for s, c in results if s is Review]
    assert all(1 <= len(r.tags) <= 3 and len(r.scores) <= 4 and all(1 <= s <= 5 for s in r.scores) for r in reviews)


def calls_from_stream(stream) -> tuple[list[dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                if d.id is not None:
                    assert d.index not in calls and d.function.name and d.type == "function"
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_forced_tool_calls_validate_against_the_function_schema(client, serve_app, tool_choice, stream):
    kwargs = dict(model=serve_app.model, messages=ASK_WEATHER, tools=TOOLS, tool_choice=tool_choice, max_tokens=96,
                  temperature=0.8, seed=3)
    if stream:
        calls, finish = calls_from_stream(client.chat.completions.create(**kwargs, stream=True))
    else:
        r = client.chat.completions.create(**kwargs)
        message, finish = r.choices[0].message, r.choices[0].finish_reason
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
        assert not message.content
    assert finish == "tool_calls" and calls
    if isinstance(tool_choice, dict):
        assert [c["name"] for c in calls] == ["get_time"]
    for call in calls:
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMA_OF[call["name"]])


def test_without_parallel_tool_calls_required_gives_one_call(client, serve_app):
    r = client.chat.completions.create(model=serve_app.model, messages=ASK_WEATHER, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False, max_tokens=96,
                                       temperature=0)
    assert len(r.choices[0].message.tool_calls) == 1


def test_conversation_with_a_tool_result_completes(client, serve_app):
    first = client.chat.completions.create(model=serve_app.model, messages=ASK_WEATHER, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           max_tokens=64, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    second = client.chat.completions.create(model=serve_app.model, messages=messages, tools=TOOLS, max_tokens=32,
                                            temperature=0)
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_guided_choice_and_regex_are_followed(client, serve_app):
    r = client.chat.completions.create(model=serve_app.model, messages=[{"role": "user", "content": "Pick one."}],
                                       max_tokens=8, temperature=1.0, n=3, seed=5,
                                       extra_body={"guided_choice": ["yes", "no", "maybe later"]})
    assert all(c.message.content in ("yes", "no", "maybe later") for c in r.choices)
    r = client.completions.create(model=serve_app.model, prompt="My phone number is", max_tokens=16,
                                  temperature=1.0, extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert __import__("re").fullmatch(r"\d{3}-\d{4}", r.choices[0].text), r.choices[0].text


def test_logit_bias_forces_and_bans_tokens(client, serve_app, smollm2_path):
    from engine.loader import load_tokenizer

    tokenizer = load_tokenizer(smollm2_path)
    token = tokenizer.encode(" banana")[0]
    r = client.completions.create(model=serve_app.model, prompt="The sky is", max_tokens=4, temperature=0,
                                  logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == tokenizer.decode([token] * 4)
    plain = client.completions.create(model=serve_app.model, prompt="The capital of France is", max_tokens=1,
                                      temperature=0)
    first = tokenizer.encode(plain.choices[0].text)[0]
    banned = client.completions.create(model=serve_app.model, prompt="The capital of France is", max_tokens=1,
                                       temperature=0, logit_bias={str(first): -100})
    assert banned.choices[0].text != plain.choices[0].text


def test_penalties_are_applied(client, serve_app):
    kwargs = dict(model=serve_app.model, prompt="one one one one one one one one", max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs, frequency_penalty=2.0).choices[0].text != plain
    assert client.completions.create(**kwargs, presence_penalty=2.0).choices[0].text != plain
    repeated = client.completions.create(**{**kwargs, "extra_body": {"ignore_eos": True, "repetition_penalty": 2.0}})
    assert repeated.choices[0].text != plain


def test_batch_of_prompts_with_n_gives_choices_in_openai_order(client, serve_app):
    prompts = ["Red is a", "The ocean is", "My cat likes"]
    for stream in (False, True):
        kwargs = dict(model=serve_app.model, prompt=prompts, n=2, max_tokens=5, temperature=1.0, seed=1, echo=True)
        if stream:
            texts: dict[int, str] = {}
            for chunk in client.completions.create(**kwargs, stream=True):
                for c in chunk.choices:
                    texts[c.index] = texts.get(c.index, "") + c.text
        else:
            r = client.completions.create(**kwargs)
            texts = {c.index: c.text for c in r.choices}
            assert r.usage.prompt_tokens == sum(len(client_tokens(serve_app, p)) for p in prompts)
        assert sorted(texts) == list(range(6))
        for index, text in texts.items():
            assert text.startswith(prompts[index // 2])  # choice i * n + j belongs to prompt i


def client_tokens(serve_app, prompt: str) -> list[int]:
    return httpx.post(f"{serve_app.base_url}/tokenize", json={"prompt": prompt}, timeout=60).json()["tokens"]


def test_echo_with_logprobs_scores_every_prompt_token(client, serve_app):
    prompt = "The capital of France is"
    ids = client_tokens(serve_app, prompt)
    for stream in (False, True):
        kwargs = dict(model=serve_app.model, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2,
                      extra_body={"ignore_eos": True})
        if stream:
            chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True) if c.choices]
            text = "".join(c.text for c in chunks)
            tokens = [t for c in chunks for t in c.logprobs.tokens]
            values = [v for c in chunks for v in c.logprobs.token_logprobs]
        else:
            choice = client.completions.create(**kwargs).choices[0]
            text, tokens, values = choice.text, choice.logprobs.tokens, choice.logprobs.token_logprobs
        assert text.startswith(prompt) and "".join(tokens) == text
        assert len(tokens) == len(ids) + 3
        assert values[0] is None and all(v <= 0 for v in values[1:])


def test_model_by_id_tokenize_and_detokenize(client, serve_app):
    assert client.models.retrieve(serve_app.model).id == serve_app.model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as http:
        tokenized = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
        assert tokenized["count"] == len(tokenized["tokens"]) == len(tokenized["token_strs"])
        assert tokenized["max_model_len"] == 8192
        back = http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()
        assert back == {"prompt": "Hello world"}
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
        assert chat["count"] > 5
        assert http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400


def test_continuous_usage_stats_put_usage_on_every_chunk(client, serve_app):
    stream = client.chat.completions.create(model=serve_app.model, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    completion = [c.usage.completion_tokens for c in chunks]
    assert completion == sorted(completion) and chunks[-1].choices == []
