"""Prompts of exact token lengths, hash-id blocks, trace replay schedules and arrival processes."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtests.arrivals import arrival_offsets, spike_users, step_users
from loadtests.datasets import (
    MOONCAKE_TRACE, SharedPrefixConfig, SyntheticConfig, TraceConfig, TraceRow, load_trace, scaled_input_length,
    shared_prefix_specs, synthetic_specs, trace_specs,
)
from loadtests.inputs import PromptCycle
from loadtests.prompts import PromptBuilder, word_token_ids
from loadtests.tokenizer import load_tokenizer



@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return word_token_ids(tokenizer)


@pytest.fixture
def builder(tokenizer, vocab):
    return PromptBuilder(tokenizer, seed=7, vocab=vocab)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@settings(max_examples=30, deadline=None)
@given(length=st.integers(min_value=1, max_value=700))
def test_synthetic_prompts_have_exactly_the_requested_tokens(tokenizer, vocab, length):
    builder = PromptBuilder(tokenizer, seed=length, vocab=vocab)
    spec = synthetic_specs(builder, SyntheticConfig(1, input_mean=length))[0]
    assert spec.input_tokens == length
    assert len(encode(tokenizer, spec.prompt)) == length


def test_requests_with_a_common_hash_prefix_share_exactly_that_token_prefix(tokenizer, builder):
    rows = [TraceRow(0, 40, 4, (1, 2, 3)), TraceRow(5, 37, 4, (1, 2, 9))]
    a, b = trace_specs(builder, rows, TraceConfig(block_size=16, trace_block_size=16))
    ta, tb = encode(tokenizer, a.prompt), encode(tokenizer, b.prompt)
    assert (len(ta), len(tb)) == (40, 37)
    assert ta[:32] == tb[:32] and ta[32] != tb[32]
    # the server sees the prompts inside its chat template: the shared prefix survives it, token for token
    chat = lambda text: encode(tokenizer, tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True))
    ca, cb = chat(a.prompt), chat(b.prompt)
    head = next(i for i in range(len(ca)) if ca[i:i + 40] == ta)  # where the prompt starts in the template
    common = next(i for i, (x, y) in enumerate(zip(ca, cb)) if x != y)
    assert common == head + 32


def test_a_hash_id_yields_the_same_tokens_whatever_came_before(tokenizer, vocab):
    first = PromptBuilder(tokenizer, seed=3, vocab=vocab)
    second = PromptBuilder(tokenizer, seed=3, vocab=vocab)
    second.hashed_tokens([42, 11], 20, 16)  # other blocks first
    second.random_tokens(50)
    assert first.hashed_tokens([5, 6], 30, 16) == second.hashed_tokens([5, 6], 30, 16)
    assert first.block(5, 16)[:7] == first.hashed_tokens([5], 7, 16)  # a short last block is the block's start
    assert PromptBuilder(tokenizer, seed=4, vocab=vocab).block(5, 16) != first.block(5, 16)


def test_lengths_that_do_not_fit_the_hash_blocks_are_refused(builder):
    with pytest.raises(ValueError, match="last block must hold"):
        builder.hashed_tokens([1, 2], 33, 16)


def test_smaller_blocks_scale_the_trace_down_keeping_whole_blocks():
    row = TraceRow(0, 40160, 6, tuple(range(79)))  # 78 full blocks of 512 + 224 tokens
    assert scaled_input_length(row, 512, 512) == 40160
    assert scaled_input_length(row, 16, 512) == 78 * 16 + 7  # 224 · 16/512 = 7
    assert scaled_input_length(TraceRow(0, 28, 1, (5,)), 16, 512) == 1
    assert scaled_input_length(TraceRow(0, 3000, 1, ()), 16, 512) == 94


def test_trace_replay_follows_the_trace_order_and_time_scaled_timing(tokenizer, builder):
    rows = load_trace(MOONCAKE_TRACE)
    specs = trace_specs(builder, rows, TraceConfig(block_size=16, time_scale=0.5, max_requests=30))
    raw = [json.loads(line) for line in MOONCAKE_TRACE.read_text().splitlines()[:30]]
    assert [s.trace_timestamp_ms for s in specs] == [r["timestamp"] for r in raw]
    assert [s.send_offset_s for s in specs] == pytest.approx([(r["timestamp"] - raw[0]["timestamp"]) / 1000 * 0.5
                                                              for r in raw])
    assert [s.index for s in specs] == list(range(30))
    for spec, r in zip(specs, raw):
        expected = scaled_input_length(TraceRow(0, r["input_length"], 0, tuple(r["hash_ids"])), 16, 512)
        assert spec.input_tokens == expected == len(encode(tokenizer, spec.prompt))
        assert spec.max_tokens == r["output_length"]


def test_trace_window_selects_by_trace_time(builder):
    rows = [TraceRow(t, 16, 2, (t,)) for t in (0, 100, 200, 300)]
    specs = trace_specs(builder, rows, TraceConfig(block_size=16, trace_block_size=16, start_ms=100, end_ms=300,
                                                   max_output_tokens=1))
    assert [s.trace_timestamp_ms for s in specs] == [100, 200]
    assert [s.send_offset_s for s in specs] == [0.0, 0.1] and {s.max_tokens for s in specs} == {1}


def test_shared_prefix_requests_share_their_prefix_exactly(tokenizer, builder):
    cfg = SharedPrefixConfig(num_requests=6, num_prefixes=2, prefix_len=48, suffix_len=10, output_mean=4)
    specs = shared_prefix_specs(builder, cfg)
    tokens = [encode(tokenizer, s.prompt) for s in specs]
    assert all(len(t) == 58 for t in tokens) and all(s.input_tokens == 58 for s in specs)
    assert tokens[0][:48] == tokens[2][:48] == tokens[4][:48] != tokens[1][:48]
    assert tokens[0][48:] != tokens[2][48:]


def test_locust_prompt_cycle_hands_out_trace_requests_in_order_forever(builder):
    rows = [TraceRow(t, 16, 2, (t,)) for t in (0, 100, 200)]
    cycle = PromptCycle(trace_specs(builder, rows, TraceConfig(block_size=16, trace_block_size=16)), builder)
    handed = [cycle.next() for _ in range(7)]
    assert [s.index for s in handed] == list(range(7))
    assert [s.trace_timestamp_ms for s in handed] == [0, 100, 200, 0, 100, 200, 0]
    assert handed[3].prompt == handed[0].prompt and all(s.send_offset_s is None for s in handed)


def test_constant_arrivals_are_evenly_spaced():
    assert arrival_offsets(5, 4.0, "constant") == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])


def test_poisson_and_gamma_arrivals_have_the_requested_rate_and_burstiness():
    n, rate = 20_000, 8.0
    poisson = np.diff(arrival_offsets(n, rate, "poisson", seed=1))
    bursty = np.diff(arrival_offsets(n, rate, "gamma", burstiness=0.25, seed=1))
    assert poisson.mean() == pytest.approx(1 / rate, rel=0.03)
    assert bursty.mean() == pytest.approx(1 / rate, rel=0.05)
    # coefficient of variation of Gamma(k) gaps is 1/sqrt(k): 1 for Poisson, 2 for burstiness 0.25
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, abs=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, abs=0.15)
    assert arrival_offsets(10, rate, "poisson", seed=5) == arrival_offsets(10, rate, "poisson", seed=5)


def test_load_shapes_step_and_spike():
    assert [step_users(t, 2, 10, 5) for t in (0, 9.9, 10, 25, 100)] == [2, 2, 4, 5, 5]
    assert [spike_users(t, 1, 8, 20, 5) for t in (0, 19.9, 20, 24.9, 25)] == [1, 1, 8, 8, 1]
