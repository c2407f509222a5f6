"""Engine behaviour on the real default model in fp32: batching, chunking, preemption, prefix cache, seeds."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from engine.loader import load_model_source

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def source(smollm2_path):
    return load_model_source(smollm2_path)


@pytest.fixture(scope="module")
def make_engine(smollm2_path, source):
    def make(**overrides) -> LLMEngine:
        config = EngineConfig(model=str(smollm2_path), dtype="float32", **{"num_kv_blocks": 512, **overrides})
        return LLMEngine(config, source=source)
    return make


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


def prompts_of_lengths(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # Ordinary vocabulary ids (the first few hundred are special and byte tokens).
    return [torch.randint(300, 40000, (n,), generator=gen).tolist() for n in lengths]


def run_alone(engine, prompt, params=GREEDY):
    return engine.generate([prompt], params)[0]


def assert_all_blocks_free(engine):
    assert not engine.has_unfinished()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)


def test_output_is_the_same_alone_and_batched_with_15_others(engine):
    prompts = prompts_of_lengths([5, 9, 14, 20, 27, 33, 41, 50, 58, 63, 71, 80, 96, 110, 127, 150])
    batched = engine.generate(prompts, GREEDY)
    for i in (0, 7, 15):
        engine.kv.reset_prefix_cache()
        assert run_alone(engine, prompts[i]) == batched[i]
    assert_all_blocks_free(engine)


def test_chunked_prefill_matches_unchunked(make_engine, engine):
    prompts = prompts_of_lengths([70, 130, 200, 33], seed=1)
    chunked_engine = make_engine(max_num_batched_tokens=64)
    chunked = chunked_engine.generate(prompts, GREEDY)
    assert max(s.num_prefill_tokens + s.num_decode_tokens for s in chunked_engine.step_history) <= 64
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in chunked_engine.step_history), \
        "expected steps that mix prefill chunks with decodes"
    engine.kv.reset_prefix_cache()
    assert engine.generate(prompts, GREEDY) == chunked


def test_steps_beside_decodes_keep_to_their_own_budget_and_answers_do_not_change(make_engine, engine):
    prompts = prompts_of_lengths([150, 150, 150], seed=2)
    capped = make_engine(max_num_batched_tokens=200, max_tokens_with_decodes=48)
    capped.add_request("first", prompts[0], GREEDY)
    [out] = capped.step()  # alone: the whole prompt in one step of the full budget
    assert capped.step_history[-1].num_prefill_tokens == 150
    for i, prompt in enumerate(prompts[1:]):
        capped.add_request(f"later-{i}", prompt, GREEDY)
    answers = {"first": list(out.new_token_ids)}
    while capped.has_unfinished():
        for out in capped.step():
            answers.setdefault(out.request_id, []).extend(out.new_token_ids)
    steps = list(capped.step_history)[1:]
    with_decodes = [s for s in steps if s.num_decode_tokens]
    assert with_decodes and all(s.num_prefill_tokens + s.num_decode_tokens <= 48 for s in with_decodes)
    assert any(s.num_prefill_tokens for s in with_decodes), "expected prompt chunks beside the decodes"
    engine.kv.reset_prefix_cache()
    assert [answers["first"], answers["later-0"], answers["later-1"]] == engine.generate(prompts, GREEDY)
    with pytest.raises(ValueError, match="max_tokens_with_decodes"):
        EngineConfig(model="m", max_tokens_with_decodes=0)


def test_small_kv_pool_preempts_and_every_request_completes_unchanged(make_engine, engine):
    prompts = prompts_of_lengths([40, 55, 61, 38, 47, 52, 60, 44], seed=2)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine.kv.reset_prefix_cache()
    expected = engine.generate(prompts, params)
    small = make_engine(num_kv_blocks=16)  # each request needs 5-7 blocks by its end
    got = small.generate(prompts, params)
    assert got == expected
    assert small.stats().num_preemptions > 0
    assert_all_blocks_free(small)


def test_second_request_sharing_a_200_token_prefix_hits_the_cache(engine):
    prefix = prompts_of_lengths([200], seed=3)[0]
    first, second = prefix + [1000, 2000, 3000], prefix + [4000, 5000]
    engine.kv.reset_prefix_cache()
    cold = run_alone(engine, second)
    engine.kv.reset_prefix_cache()
    run_alone(engine, first)
    engine.add_request("warm", second, GREEDY)
    tokens, cached = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
    assert cached >= 192
    assert tokens == cold


def test_last_prompt_token_is_recomputed_on_a_full_hit(engine):
    prompt = prompts_of_lengths([64], seed=4)[0]  # exactly 4 full blocks
    engine.kv.reset_prefix_cache()
    first = run_alone(engine, prompt)
    engine.add_request("again", prompt, GREEDY)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].num_cached_tokens == 48
    assert [t for o in outs for t in o.new_token_ids] == first


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(engine):
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    prompt, *others = prompts_of_lengths([30, 12, 44, 27, 60], seed=5)
    alone = run_alone(engine, prompt, params)
    unseeded = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    batched = engine.generate([prompt] + others, [dataclasses.replace(params)] + [unseeded] * len(others))[0]
    assert alone == batched
    assert run_alone(engine, prompt, dataclasses.replace(params, seed=99)) != alone


@pytest.mark.parametrize("prompt, params, match", [
    ([5, 6, 7], SamplingParams(temperature=-0.5), "temperature"),
    ([5, 6, 7], SamplingParams(top_p=0.0), "top_p"),
    ([5, 6, 7], SamplingParams(top_p=1.5), "top_p"),
    ([5, 6, 7], SamplingParams(max_tokens=0), "max_tokens"),
    ([], SamplingParams(), "empty"),
    ([5] * 9000, SamplingParams(max_tokens=16), "9000 tokens"),
    ([5, 6, 7], SamplingParams(max_tokens=8190), "8190"),
    ([10**9], SamplingParams(), "token ids"),
    ([5, 6, 7], SamplingParams(logprobs=50), "logprobs"),
])
def test_bad_parameters_raise_and_leave_state_unchanged(engine, prompt, params, match):
    before = (engine.stats(), len(engine.requests), engine.kv.pool.num_free_blocks)
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request("bad", prompt, params)
    assert (engine.stats(), len(engine.requests), engine.kv.pool.num_free_blocks) == before
    assert run_alone(engine, [5, 6, 7], SamplingParams(max_tokens=3, temperature=0)) != []


def test_too_long_prompt_error_names_both_numbers(engine):
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("long", [5] * 8000, SamplingParams(max_tokens=500))
    assert "8000" in str(err.value) and "500" in str(err.value) and "8192" in str(err.value)


def test_abort_frees_blocks_and_stops_outputs(engine):
    engine.add_request("to-abort", prompts_of_lengths([100], seed=6)[0], SamplingParams(max_tokens=50))
    engine.step()
    assert engine.kv.pool.num_free_blocks < engine.kv.pool.num_blocks
    assert engine.abort("to-abort")
    assert not engine.abort("to-abort")
    assert_all_blocks_free(engine)
    assert engine.step() == []


def test_stop_token_ids_min_tokens_and_max_tokens(engine):
    prompt = prompts_of_lengths([20], seed=7)[0]
    free_run = run_alone(engine, prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    stop_at = free_run[4]
    first = free_run.index(stop_at)
    stopped = run_alone(engine, prompt, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at]))
    assert stopped == free_run[:first + 1]
    forced = run_alone(engine, prompt, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at],
                                                      min_tokens=first + 2))
    assert len(forced) > first + 1 and stop_at not in forced[:first + 2]
    assert len(run_alone(engine, prompt, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))) == 7


def test_logprobs_with_top_alternatives(engine):
    prompt = prompts_of_lengths([25], seed=8)[0]
    engine.add_request("lp", prompt, SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    lps = [lp for o in outs for lp in o.logprobs]
    assert len(lps) == 4
    for lp in lps:
        assert len(lp.top) == 3
        assert lp.top[0][0] == lp.token_id  # greedy: the sampled token is the most likely
        assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_stats_count_prefix_queries_and_hits_in_tokens(engine):
    prompt = prompts_of_lengths([100], seed=9)[0]
    engine.kv.reset_prefix_cache()
    before = engine.stats()
    run_alone(engine, prompt)
    run_alone(engine, prompt)
    after = engine.stats()
    assert after.prefix_cache_queries - before.prefix_cache_queries == 200
    assert after.prefix_cache_hits - before.prefix_cache_hits == 96
    step = engine.step_history[-1]
    assert step.duration_s > 0 and 0 <= step.kv_usage <= 1
