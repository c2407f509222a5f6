"""Each engine request's lifecycle events: ordered, bounded, cheap, and showing preemption when the pool runs short."""
from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.request import MAX_REQUEST_EVENTS, EventKind, Request, RequestStatus
from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-events")
    write_tiny_model(path, "llama")
    return str(path)


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Runs prompts to the end; returns each request's final RequestTimings by id."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    timings = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                timings[out.request_id] = out.timings
    assert not engine.has_unfinished()
    return timings


def kinds(timings) -> list[EventKind]:
    return [e.kind for e in timings.events]


def test_events_follow_the_request_through_chunked_prefill_and_decode(tiny_path):
    engine = LLMEngine(EngineConfig(model=tiny_path, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    timings = run(engine, [[5] * 70], params)["r0"]
    assert kinds(timings) == [EventKind.ENQUEUED, EventKind.SCHEDULED, EventKind.PREFILL_CHUNK,
                              EventKind.PREFILL_CHUNK, EventKind.PREFILL_CHUNK, EventKind.FIRST_TOKEN,
                              EventKind.FINISHED]
    chunks = [e.value for e in timings.events if e.kind == EventKind.PREFILL_CHUNK]
    assert chunks == [32, 32, 6]
    times = [e.time for e in timings.events]
    assert times == sorted(times)
    assert timings.events[-1].value == RequestStatus.FINISHED_LENGTH
    assert timings.num_decode_steps == 9  # the first of 10 tokens comes from the prefill step
    assert timings.num_dropped_events == 0


def test_a_preempted_request_records_preemption_and_resumption(tiny_path):
    # 8 requests of 40 prompt + 40 output tokens need 5 blocks of 16 each at the end: 40 blocks, the pool has 16.
    engine = LLMEngine(EngineConfig(model=tiny_path, dtype="float32", num_kv_blocks=16))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    timings = run(engine, [[7 + i] * 40 for i in range(8)], params)
    assert engine.stats().num_preemptions > 0
    preempted = [t for t in timings.values() if EventKind.PREEMPTED in kinds(t)]
    assert preempted
    for t in preempted:
        k = kinds(t)
        assert k.count(EventKind.PREEMPTED) == k.count(EventKind.RESUMED) == len(t.preemptions)
        for i, kind in enumerate(k):
            if kind == EventKind.PREEMPTED:  # back in the queue, then scheduled again (and recomputed, often
                assert k[i + 1] == EventKind.RESUMED  # from the prefix cache all but its last token: a decode)
        assert k[0] == EventKind.ENQUEUED and k[-1] == EventKind.FINISHED
        assert [e.time for e in t.events] == sorted(e.time for e in t.events)
    for t in timings.values():
        assert kinds(t).count(EventKind.FIRST_TOKEN) == 1


def test_events_are_bounded_and_keep_the_finish():
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), block_size=16)
    for _ in range(3 * MAX_REQUEST_EVENTS):
        request.timings.record(EventKind.PREFILL_CHUNK, 1)
    request.timings.record(EventKind.FINISHED, int(RequestStatus.FINISHED_STOPPED))
    events = request.timings.events
    assert len(events) == MAX_REQUEST_EVENTS and events[-1].kind == EventKind.FINISHED
    assert request.timings.num_dropped_events == 2 * MAX_REQUEST_EVENTS + 1


def test_events_off_records_nothing(tiny_path):
    engine = LLMEngine(EngineConfig(model=tiny_path, dtype="float32", num_kv_blocks=64,
                                    record_request_events=False))
    timings = run(engine, [[5] * 20], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))["r0"]
    assert timings.events is None and timings.first_token is not None and timings.num_decode_steps == 2
