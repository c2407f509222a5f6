"""The OpenAI API end to end: the official client, sync and async, against the real app on Ray Serve."""
from __future__ import annotations

import asyncio
import itertools

import openai
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.serve]

# Asked so that the default model's greedy answer is clear-cut: to "What is the capital of France?" its first token
# is "The" or "L'" by 0.03-0.1 in log-probability, which bf16 rounding in a different kernel (oneDNN's linears for
# prefill steps where the CPU has AMX, a prompt read from the prefix cache) flips; here every token leads by >= 1.
QUESTION = [{"role": "user", "content": "Name the capital of France."}]
_salts = itertools.count()


def own_cache() -> dict:
    """A prefix-cache salt of its own, for a request compared token for token with another: both then compute the
    same steps. Where the CPU has AMX, a prompt read from the cache leaves a short step on the native linear kernel
    instead of oneDNN's, and a bf16 greedy answer can differ at a near-tie (README: native_linear_max_rows)."""
    return {"cache_salt": f"compared-{next(_salts)}"}


@pytest.fixture(scope="module")
def client(serve_app) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{serve_app.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def async_client(serve_app) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{serve_app.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_model(client, serve_app):
    models = client.models.list().data
    assert [m.id for m in models] == [serve_app.model]


def test_chat_answers_with_usage(client, serve_app):
    r = client.chat.completions.create(model=serve_app.model, messages=QUESTION, max_tokens=24, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10 and 0 < r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_respects_max_tokens_and_echo(client, serve_app):
    prompt = "The capital of France is"
    r = client.completions.create(model=serve_app.model, prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text.startswith(prompt) and len(r.choices[0].text) > len(prompt)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6


def test_completion_accepts_token_id_prompts(client, serve_app, smollm2_path):
    from engine.loader import load_tokenizer

    prompt = "Hello, my name is"
    ids = load_tokenizer(smollm2_path).encode(prompt)
    by_text = client.completions.create(model=serve_app.model, prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body=own_cache())
    by_ids = client.completions.create(model=serve_app.model, prompt=ids, max_tokens=8, temperature=0,
                                       extra_body=own_cache())
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_streamed_chat_equals_non_streamed_for_greedy(client, serve_app):
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    whole = client.chat.completions.create(model=serve_app.model, messages=messages, max_tokens=40, temperature=0,
                                           extra_body=own_cache())
    chunks = list(client.chat.completions.create(model=serve_app.model, messages=messages, max_tokens=40,
                                                 temperature=0, stream=True, extra_body=own_cache()))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == whole.choices[0].message.content


def test_async_streamed_completion_equals_non_streamed(serve_app):
    async def run() -> tuple[str, str, object]:
        async with async_client(serve_app) as c:
            kwargs = dict(model=serve_app.model, prompt="Once upon a time", max_tokens=32, temperature=0)
            whole = await c.completions.create(**kwargs, extra_body=own_cache())
            stream = await c.completions.create(**kwargs, stream=True, stream_options={"include_usage": True},
                                                extra_body=own_cache())
            parts, usage = [], None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                    assert chunk.choices == []
                parts.extend(choice.text for choice in chunk.choices)
            return whole.choices[0].text, "".join(parts), (whole.usage, usage)

    whole, streamed, (whole_usage, stream_usage) = asyncio.run(run())
    assert streamed == whole
    assert stream_usage is not None and stream_usage.completion_tokens == whole_usage.completion_tokens


def test_n_returns_distinct_choices(client, serve_app):
    r = client.chat.completions.create(model=serve_app.model, messages=QUESTION, max_tokens=16, n=2,
                                       temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert r.choices[0].message.content != r.choices[1].message.content  # each choice gets its own seed
    assert 2 <= r.usage.completion_tokens <= 32  # both choices' tokens, the prompt counted once


def test_n_streams_every_choice_to_its_end(client, serve_app):
    stream = client.completions.create(model=serve_app.model, prompt="List three colors:", max_tokens=10, n=3,
                                       temperature=0.8, seed=1, stream=True, extra_body={"ignore_eos": True})
    texts, finished = {0: "", 1: "", 2: ""}, set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2} and all(texts.values())


def test_seed_makes_sampling_reproducible(client, serve_app):
    kwargs = dict(model=serve_app.model, prompt="My favourite animal is", max_tokens=16, temperature=1.0)
    a = client.completions.create(**kwargs, seed=1234).choices[0].text
    b = client.completions.create(**kwargs, seed=1234).choices[0].text
    others = {client.completions.create(**kwargs, seed=s).choices[0].text for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1


def test_stop_string_is_never_emitted(client, serve_app):
    kwargs = dict(model=serve_app.model, prompt="Count: one, two, three, four, five,", max_tokens=24, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    assert len(full) > 8
    stop = full[4:8]  # a string the greedy output is known to contain
    cut = full[:full.index(stop)]
    r = client.completions.create(**kwargs, stop=[stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stop=stop, stream=True))
    assert streamed == cut


def test_chat_logprobs_rank_the_sampled_token_first(client, serve_app):
    r = client.chat.completions.create(model=serve_app.model, messages=QUESTION, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-3


def test_completion_logprobs_use_the_legacy_shape(client, serve_app):
    r = client.completions.create(model=serve_app.model, prompt="The sky is", max_tokens=5, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(top) <= 2 and v <= 0 for top, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_repeated_long_prompt_is_served_from_the_prefix_cache(client, serve_app):
    document = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(60))
    messages = [{"role": "user", "content": f"{document}\nWhich fact mentions 49?"}]
    cached = []
    for _ in range(3):  # two replicas: by the third request, one of them has seen the prompt before
        r = client.chat.completions.create(model=serve_app.model, messages=messages, max_tokens=4, temperature=0)
        assert r.usage.prompt_tokens > 500
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert max(cached) >= 480, cached


def test_n_choices_share_the_prompt_prefix_cache(client, serve_app):
    document = " ".join(f"Item {i} costs {3 * i} dollars." for i in range(80))
    r = client.completions.create(model=serve_app.model, prompt=document, max_tokens=4, n=2, temperature=0.7,
                                  seed=3)
    assert r.usage.prompt_tokens > 400
    assert r.usage.prompt_tokens_details.cached_tokens >= 400


def test_ignore_eos_and_min_tokens_control_length(client, serve_app):
    r = client.chat.completions.create(model=serve_app.model, messages=[{"role": "user", "content": "Say hi."}],
                                       max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 30 and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model=serve_app.model, messages=[{"role": "user", "content": "Say hi."}],
                                       max_tokens=30, temperature=0, extra_body={"min_tokens": 12})
    assert r.usage.completion_tokens >= 12


def test_max_completion_tokens_and_user_are_accepted(client, serve_app):
    r = client.chat.completions.create(model=serve_app.model, messages=QUESTION, max_completion_tokens=3,
                                       temperature=0, user="someone", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
