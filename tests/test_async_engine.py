"""AsyncEngine: streams, cancellation that frees blocks, errors before anything is queued."""
from __future__ import annotations

import asyncio
import time

import pytest

from engine import AsyncEngine, EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def async_engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-async")
    write_tiny_model(path, "llama")
    engine = AsyncEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=256))
    yield engine
    engine.shutdown()


async def collect(engine, prompt, params, **kw):
    outs = [o async for o in engine.generate(prompt, params, **kw)]
    return [t for o in outs for t in o.new_token_ids], outs


def test_concurrent_streams_match_the_sync_engine(async_engine):
    prompts = [[3 + i] * (10 + 7 * i) for i in range(12)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(collect(async_engine, p, params) for p in prompts))

    results = asyncio.run(main())
    # A separate engine on the same model: the async engine's step loop may wake and step any request it holds.
    expected = LLMEngine(async_engine.engine.config).generate(prompts, params)
    assert [tokens for tokens, _ in results] == expected
    for _, outs in results:
        assert outs[-1].finished and outs[-1].finish_reason == "length" and outs[-1].timings.first_token


def test_cancelling_a_stream_aborts_and_frees_its_blocks(async_engine):
    async def main():
        stream = async_engine.generate([9] * 40, SamplingParams(max_tokens=500, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            stats = async_engine.stats()
            if stats.num_running == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks:
                return stats
            await asyncio.sleep(0.05)
        return async_engine.stats()

    stats = asyncio.run(main())
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_task_cancellation_aborts(async_engine):
    async def main():
        task = asyncio.create_task(collect(async_engine, [5] * 30, SamplingParams(max_tokens=800, ignore_eos=True)))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if async_engine.stats().num_running == 0:
                break
            await asyncio.sleep(0.05)
        return async_engine.stats()

    assert asyncio.run(main()).num_running == 0


def test_bad_request_raises_before_streaming(async_engine):
    async def main():
        with pytest.raises(InvalidRequestError, match="top_p"):
            await collect(async_engine, [1, 2], SamplingParams(top_p=2.0))
        with pytest.raises(InvalidRequestError, match="maximum context length"):
            await collect(async_engine, [1] * 1000, SamplingParams(max_tokens=100))
        tokens, _ = await collect(async_engine, [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
        return tokens

    assert len(asyncio.run(main())) == 3
    assert async_engine.is_healthy


def test_event_loop_stays_responsive_while_the_engine_steps(async_engine):
    async def main():
        gen = asyncio.create_task(collect(async_engine, [4] * 200, SamplingParams(max_tokens=200, ignore_eos=True)))
        gaps, last = [], time.perf_counter()
        while not gen.done():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        await gen
        return gaps

    gaps = asyncio.run(main())
    assert len(gaps) > 5 and sorted(gaps)[len(gaps) // 2] < 0.1


def test_full_waiting_queue_refuses_new_requests_and_admits_again_once_it_drains(tmp_path):
    from engine import EngineOverloadedError

    write_tiny_model(tmp_path, "llama")
    engine = AsyncEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=256, max_num_seqs=1,
                                      max_num_waiting=2))
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main():
        first = [asyncio.create_task(collect(engine, [7] * 12, params))]
        deadline = time.monotonic() + 30
        while engine.stats().num_running == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        first += [asyncio.create_task(collect(engine, [7] * 12, params)) for _ in range(2)]  # they wait
        await asyncio.sleep(0)  # each task reaches the engine's inbox
        assert engine.num_waiting == 2 and not engine.has_room()
        with pytest.raises(EngineOverloadedError, match="max_num_waiting=2"):
            await collect(engine, [7] * 12, params)
        done = await asyncio.wait_for(asyncio.gather(*first), timeout=60)
        assert engine.has_room(2)
        tokens, _ = await collect(engine, [7] * 12, params)  # room again once the queue drained
        assert engine.stats().num_waiting == 0 and engine.is_healthy
        return done, tokens

    try:
        done, tokens = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [len(t) for t, _ in done] == [200, 200, 200] and len(tokens) == 200


def test_other_threads_read_the_steps_and_cached_blocks_the_step_thread_published(async_engine):
    from engine.hashing import hash_block_chain

    prompt = [21] * 40  # two full blocks of 16 tokens cached, the rest recomputed
    before = async_engine.recent_steps()
    async_engine.publish_block_hashes = True
    try:
        tokens, _ = asyncio.run(collect(async_engine, prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
    finally:
        async_engine.publish_block_hashes = False
    steps = async_engine.recent_steps()
    assert len(tokens) == 3 and steps[-1].step > (before[-1].step if before else 0)
    assert [s.step for s in steps] == sorted(s.step for s in steps)
    block_size = async_engine.config.block_size
    assert set(hash_block_chain(prompt, block_size)) <= set(async_engine.cached_block_hashes().tolist())
    info = async_engine.model_info()
    assert info.limits.num_kv_blocks == 256 and info.limits.block_size == block_size
