"""Property: whatever a request asks for, the engine runs it or refuses it at the border with InvalidRequestError.

Random SamplingParams (every field, valid or not, extremes and wrong types, several at once), random prompts and
random `n`, several requests per batch, on a tiny random Llama with a small context, KV pool and token budget (so
the size checks, chunked prefill and preemption all come into play). Every accepted request must finish without
a failure, no step may raise, and the block pool must be whole afterwards.
"""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from tests.tiny_models import write_tiny_model

VOCAB = 512  # tests/tiny_models.py
MAX_MODEL_LEN = 160
MAX_STEPS = 3000

odd = st.sampled_from([None, "4", 3.5, True, [1], math.nan, math.inf, -math.inf, 10**30, -(10**30)])
fraction = st.one_of(st.floats(0, 1), st.sampled_from([0.0, 1e-12, 0.999999, 1.0, 1.0000001, -0.1, 2.0]), odd)
token = st.one_of(st.integers(-3, VOCAB + 3), st.sampled_from([0, 1, 2, VOCAB - 1, VOCAB, 99999999, -(2**63)]))
seeds = st.one_of(st.none(), st.integers(-(2**70), 2**70), st.sampled_from([2**63 - 1, -(2**63), 2**64 - 1]))

# Within bounds, at their edges: these run, so they exercise the sampler's features together.
valid_fields = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(1, 24),
    "temperature": st.one_of(st.floats(0, 3), st.sampled_from([0.0, 1e-30, 1e-5, 2e-5, 100.0, 1e300])),
    "top_p": st.one_of(st.floats(1e-12, 1), st.sampled_from([1e-12, 1.0])),
    "top_k": st.one_of(st.integers(-1, VOCAB + 3), st.sampled_from([1, 10**9])),
    "min_p": st.one_of(st.floats(0, 1), st.sampled_from([0.0, 1.0])),
    "seed": seeds,
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=8),
    "stop": st.lists(st.text(min_size=1, max_size=8), max_size=4),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 24),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)),
})
# Anything: out of range, wrong types, too long, as a client might send.
any_fields = st.fixed_dictionaries({}, optional={
    "max_tokens": st.one_of(st.integers(-2, 24), st.sampled_from([0, 150, 2000, 10**12]), odd),
    "temperature": st.one_of(st.floats(-1, 3), st.sampled_from([1e-30, 1e300, -1.0]), odd),
    "top_p": fraction,
    "top_k": st.one_of(st.integers(-3, VOCAB + 3), st.sampled_from([10**9]), odd),
    "min_p": fraction,
    "seed": st.one_of(seeds, odd),
    "stop_token_ids": st.one_of(st.lists(token, max_size=8), st.lists(token, min_size=60, max_size=70), odd),
    "stop": st.one_of(st.lists(st.text(max_size=8), max_size=4),
                      st.lists(st.text(min_size=250, max_size=300), max_size=2),
                      st.lists(st.just("x"), min_size=7, max_size=10), odd),
    "ignore_eos": st.one_of(st.booleans(), odd),
    "min_tokens": st.one_of(st.integers(-1, 30), st.sampled_from([10**9]), odd),
    "logprobs": st.one_of(st.none(), st.integers(-1, 22), odd),
})
valid_request = st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=100), valid_fields,
                          st.integers(1, 3))
any_request = st.tuples(st.lists(token, max_size=180), any_fields, st.one_of(st.integers(-1, 4), st.just(17)))
requests = st.lists(st.one_of(valid_request, any_request), min_size=1, max_size=4)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-properties")
    write_tiny_model(path, "llama")
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4, num_kv_blocks=96,
                                  max_num_batched_tokens=48, max_num_seqs=4, max_model_len=MAX_MODEL_LEN))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(batch=requests)
def test_every_request_runs_or_is_refused_at_the_border_and_the_pool_stays_whole(engine, batch):
    accepted: dict[str, int] = {}
    for i, (prompt, fields, n) in enumerate(batch):
        try:
            params = SamplingParams(**fields)
            engine.validate(prompt, params, n)
        except InvalidRequestError:
            continue
        for choice in range(n):
            request_id = f"r{i}-{choice}"
            engine.add_request(request_id, prompt, params.for_choice(choice))
            accepted[request_id] = params.max_tokens
    finished: dict[str, int] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            assert out.failure is None, (out.request_id, out.failure, batch)
            finished[out.request_id] = finished.get(out.request_id, 0) + len(out.new_token_ids)
            assert out.new_token_ids == [] or all(0 <= t < VOCAB for t in out.new_token_ids)
    assert not engine.has_unfinished()
    assert set(finished) == set(accepted)
    assert all(1 <= finished[r] <= accepted[r] for r in accepted), (finished, accepted)
    pool = engine.kv.pool
    assert not engine.requests and pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_the_request_that_took_a_replica_down_is_refused_at_the_border(engine):
    with pytest.raises(InvalidRequestError) as refused:
        engine.validate([5, 6], SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=[99999999]))
    assert refused.value.param == "stop_token_ids" and refused.value.code == "invalid_token_id"


def test_seeds_wrap_into_64_bits_so_every_choice_has_one():
    for seed in (2**63 - 1, 2**64 - 1, 2**70, -(2**63), -(2**70)):
        params = SamplingParams(seed=seed)
        for choice in range(3):
            assert -(2**63) <= params.for_choice(choice).seed < 2**63
    assert SamplingParams(seed=2**63).seed == -(2**63) and SamplingParams(seed=5).for_choice(2).seed == 7
