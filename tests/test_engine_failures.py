"""A failing step fails its batch, not the engine; a fatal one stops the loop; a request past its deadline is
dropped before prefill. On a tiny random Llama, through the engine's own test hook (`inject_step_fault`)."""
from __future__ import annotations

import asyncio
import time

import pytest

from engine import AsyncEngine, EngineConfig, EngineDeadError, LLMEngine, SamplingParams
from engine.failures import EngineFatalError, FailureKind
from tests.tiny_models import tiny_engine, tiny_llama_source

LONG = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_source(tmp_path_factory.mktemp("tiny-failures"))


def make_engine(tiny, **overrides) -> LLMEngine:
    return tiny_engine(tiny, block_size=4, **{"num_kv_blocks": 64, **overrides})


def run_to_end(engine: LLMEngine, max_steps: int = 500) -> dict[str, list]:
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert not engine.has_unfinished()
    return outputs


def assert_pool_whole(engine: LLMEngine) -> None:
    pool = engine.kv.pool
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
    for block_hash, block_id in pool.cached.items():
        assert pool.blocks[block_id].block_hash == block_hash


def test_failed_step_fails_its_batch_only_and_the_engine_goes_on(tiny):
    engine = make_engine(tiny, max_num_seqs=2)
    prompts = {"a": [5] * 13, "b": [7] * 9, "c": [9] * 11}
    expected = make_engine(tiny).generate(list(prompts.values()), LONG)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, LONG)  # c waits: two sequences at most
    engine.step()
    engine.step()
    engine.inject_step_fault(lambda request: request.request_id == "a")
    failed = engine.step()
    assert sorted(o.request_id for o in failed) == ["a", "b"]  # the batch: a and b, not c
    for out in failed:
        assert out.finished and out.finish_reason == "error" and out.new_token_ids == []
        assert out.failure.kind == FailureKind.STEP_FAILED and out.failure.code == "engine_step_failed"
    rest = run_to_end(engine)
    assert list(rest) == ["c"] and [t for o in rest["c"] for t in o.new_token_ids] == expected[2]
    assert_pool_whole(engine)
    # Nothing the failed step was writing stayed in the prefix cache: the same prompts give the same tokens.
    assert engine.generate([prompts["a"], prompts["b"]], LONG) == expected[:2]
    assert engine.stats().num_finished_requests == 5


def test_blocks_the_failed_step_was_filling_leave_the_prefix_cache(tiny):
    engine = make_engine(tiny)
    prompt = list(range(20, 42))  # 22 tokens: 5 full blocks of 4
    engine.add_request("chunked", prompt, LONG)
    engine.inject_step_fault(lambda request: True)
    [out] = engine.step()  # the prefill step fails: none of its blocks was computed
    assert out.failure is not None and not engine.kv.pool.cached
    hits, num_cached = engine.kv.get_computed_blocks(engine_request(engine, prompt))
    assert hits == [] and num_cached == 0
    assert_pool_whole(engine)


def engine_request(engine: LLMEngine, prompt: list[int]):
    from engine.request import Request

    return Request("probe", prompt, LONG, engine.config.block_size)


def test_error_that_leaves_engine_state_unknown_escapes_the_step(tiny):
    engine = make_engine(tiny)
    engine.add_request("x", [3, 4, 5], LONG)
    engine.inject_step_fault(lambda request: True, EngineFatalError("the device is gone"))
    with pytest.raises(EngineFatalError):
        engine.step()


def test_waiting_request_past_its_deadline_is_dropped_before_any_prefill(tiny):
    engine = make_engine(tiny, max_num_seqs=1)
    engine.add_request("running", [5] * 8, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("late", [6] * 8, LONG, deadline=time.time() + 0.05)
    engine.add_request("patient", [7] * 8, SamplingParams(max_tokens=2), deadline=time.time() + 600)
    engine.step()
    time.sleep(0.1)
    outputs = run_to_end(engine)
    [late] = outputs["late"]
    assert late.finish_reason == "error" and late.failure.kind == FailureKind.DEADLINE_PASSED
    assert late.failure.code == "request_timeout" and late.timings.first_scheduled is None
    assert outputs["patient"][-1].finish_reason == "length"
    assert_pool_whole(engine)


def test_async_engine_streams_outside_the_failed_batch_keep_streaming(tiny):
    path, source = tiny
    engine = AsyncEngine(EngineConfig(model=path, dtype="float32", max_num_seqs=1, num_kv_blocks=64),
                         LLMEngine(EngineConfig(model=path, dtype="float32", max_num_seqs=1, num_kv_blocks=64),
                                   source=source))

    async def collect(prompt):
        return [o async for o in engine.generate(prompt, LONG)]

    async def main():
        engine.engine.inject_step_fault(lambda request: request.prompt_token_ids[0] == 11)
        return await asyncio.gather(collect([11] * 6), collect([12] * 6))

    try:
        faulted, other = asyncio.run(main())
        assert faulted[-1].failure.kind == FailureKind.STEP_FAILED and faulted[-1].finished
        assert other[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in other) == 40
        assert engine.is_healthy
    finally:
        engine.shutdown()


def test_async_engine_that_dies_tells_every_stream_and_calls_on_death(tiny):
    path, source = tiny
    deaths: list[BaseException] = []
    config = EngineConfig(model=path, dtype="float32", num_kv_blocks=64)
    engine = AsyncEngine(config, LLMEngine(config, source=source), on_death=deaths.append)

    async def main():
        engine.engine.inject_step_fault(lambda request: True, EngineFatalError("the device is gone"))
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate([4] * 5, LONG):
                pass
        with pytest.raises(EngineDeadError):  # refused at once afterwards, never queued
            async for _ in engine.generate([4] * 5, LONG):
                pass

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()  # joins the step thread, which calls on_death last
    assert not engine.is_healthy and len(deaths) == 1 and isinstance(deaths[0], EngineFatalError)
