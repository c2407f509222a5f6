"""Tenants inside one engine (a tiny random Llama): fair share by weighted token counters, priorities that jump
the queue and preempt, and prefix-cache salts that keep tenants' cached blocks apart."""
from __future__ import annotations

import itertools

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.request import RequestStatus
from engine.tenancy import FairShare, Tenancy
from tests.tiny_models import tiny_llama_source

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    return tiny_llama_source(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def make_engine(tiny_source):
    path, source = tiny_source

    def make(**overrides) -> LLMEngine:
        config = dict(model=path, dtype="float32", block_size=4, num_kv_blocks=256, max_num_batched_tokens=64,
                      max_num_seqs=4, prepack_weights=False, num_threads=1)
        return LLMEngine(EngineConfig(**{**config, **overrides}), source=source)
    return make


def prompt(i: int, length: int = 24) -> list[int]:
    return [(i * 31 + k * 7) % 500 + 3 for k in range(length)]


def admission_order(engine: LLMEngine) -> list[str]:
    """Steps until every request finished; the ids in the order they first ran."""
    order: list[str] = []
    for _ in range(200):
        engine.step()
        order += [r.request_id for r in engine.scheduler.running if r.request_id not in order]
        if not engine.has_unfinished():
            break
    return order


def cost(request, fair: FairShare) -> float:
    return request.num_prompt_tokens * fair.prompt_token_weight + request.num_output_tokens * fair.output_token_weight


def test_backlogged_tenants_get_their_weighted_share_and_one_alone_gets_everything(make_engine):
    engine = make_engine()
    a, b = Tenancy("a", weight=1.0), Tenancy("b", weight=2.0)
    ids = itertools.count()
    served = {"a": 0.0, "b": 0.0}
    waiting = {"a": 0, "b": 0}

    def top_up(tenancy: Tenancy, depth: int) -> None:
        while waiting[tenancy.tenant] < depth:
            i = next(ids)
            engine.add_request(f"{tenancy.tenant}-{i}", prompt(i, 16 + i % 17), PARAMS, tenancy=tenancy)
            waiting[tenancy.tenant] += 1

    def step() -> list:
        outputs = engine.step()
        for out in outputs:
            if out.finished:
                tenant = out.request_id.split("-")[0]
                served[tenant] += out.num_prompt_tokens * 1.0 + out.num_output_tokens * 2.0
        waiting.update(a=sum(r.tenancy.tenant == "a" for r in engine.scheduler.waiting),
                       b=sum(r.tenancy.tenant == "b" for r in engine.scheduler.waiting))
        return outputs

    for _ in range(400):  # A keeps ten times B's requests waiting
        top_up(a, 20)
        top_up(b, 2)
        step()
    share_b = served["b"] / (served["a"] + served["b"])
    assert abs(share_b - 2 / 3) <= 0.1 * 2 / 3, (served, engine.scheduler.num_preemptions)

    while waiting["b"] or any(r.tenancy.tenant == "b" for r in engine.scheduler.running):
        top_up(a, 20)
        step()
    for _ in range(50):  # B stopped: nothing of the engine is left idle
        top_up(a, 20)
        step()
        scheduled = engine.scheduler.last_output.scheduled
        assert {s.request.tenancy.tenant for s in scheduled} == {"a"}
        assert len(scheduled) == 4  # every batch slot


def test_tenant_with_nothing_running_takes_a_batch_slot_from_the_tenant_holding_them_all(make_engine):
    engine = make_engine(max_num_seqs=4)
    long = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for i in range(12):
        engine.add_request(f"a-{i}", prompt(i), long, tenancy=Tenancy("a"))
    for _ in range(5):
        engine.step()
    engine.add_request("b-0", prompt(50), PARAMS, tenancy=Tenancy("b"))
    engine.step()
    out = engine.scheduler.last_output
    assert [r.request_id for r in out.preempted] == ["a-3"]  # a's newest gives its slot up
    assert engine.requests["b-0"].status == RequestStatus.RUNNING
    for _ in range(3):
        engine.step()
    engine.add_request("b-1", prompt(51), PARAMS, tenancy=Tenancy("b"))
    engine.step()  # b holds a slot already: b-1 waits its turn, nobody is preempted for it
    assert not engine.scheduler.last_output.preempted
    assert engine.requests["b-1"].status == RequestStatus.WAITING


LONG = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)


def test_first_prefill_of_a_tenant_with_nothing_running_runs_alone_while_the_busy_tenant_is_backlogged(make_engine):
    engine = make_engine(max_num_seqs=6)
    for i in range(2):
        engine.add_request(f"a-{i}", prompt(i), LONG, tenancy=Tenancy("a"))
    for _ in range(3):
        engine.step()  # a's two are decoding; four slots are free
    for i in (2, 3):
        engine.add_request(f"a-{i}", prompt(i), PARAMS, tenancy=Tenancy("a"))
    engine.add_request("b-0", prompt(50), PARAMS, tenancy=Tenancy("b"))
    engine.add_request("c-0", prompt(60), PARAMS, tenancy=Tenancy("c"))
    engine.step()
    # b's and c's first prefills run as on an idle replica: no decode of a's, no prefill of a's waiting ones.
    assert {s.request.request_id for s in engine.scheduler.last_output.scheduled} == {"b-0", "c-0"}
    assert engine.requests["a-2"].status == engine.requests["a-3"].status == RequestStatus.WAITING
    engine.step()  # then everyone: a's decodes, b's and c's, a's waiting prefills
    step = engine.scheduler.last_output.scheduled
    assert {s.request.request_id for s in step} == {"a-0", "a-1", "a-2", "a-3", "b-0", "c-0"}


def test_newcomer_prefill_shares_the_step_when_nobody_is_backlogged_and_no_busy_prefill_joins_it(make_engine):
    engine = make_engine(max_num_seqs=6)
    for i in range(2):
        engine.add_request(f"a-{i}", prompt(i), LONG, tenancy=Tenancy("a"))
    for _ in range(3):
        engine.step()
    engine.add_request("b-0", prompt(50), PARAMS, tenancy=Tenancy("b"))
    engine.step()  # a has nothing waiting: b's prefill rides with a's decodes, as in any step
    assert {s.request.request_id for s in engine.scheduler.last_output.scheduled} == {"a-0", "a-1", "b-0"}
    engine.add_request("c-0", prompt(60), PARAMS, tenancy=Tenancy("c"))
    engine.add_request("a-2", prompt(2), PARAMS, tenancy=Tenancy("a"))
    engine.step()  # a backlogged, but c's step is the fourth since the last lone one: c first, then a waits
    step = {s.request.request_id for s in engine.scheduler.last_output.scheduled}
    assert "c-0" in step and "a-2" not in step


def test_running_requests_lose_at_most_one_step_in_solo_step_period_however_often_tenants_arrive(make_engine):
    from engine.scheduler import SOLO_STEP_PERIOD

    engine = make_engine(max_num_seqs=12, max_num_batched_tokens=256)
    for i in range(16):  # more than the slots: a stays backlogged
        engine.add_request(f"a-{i}", prompt(i), LONG, tenancy=Tenancy("a"))
    for _ in range(2):
        engine.step()
    without_a = 0
    num_steps = 4 * SOLO_STEP_PERIOD
    for k in range(num_steps):  # a new tenant every step
        engine.add_request(f"n{k}-0", prompt(100 + k, 8), PARAMS, tenancy=Tenancy(f"n{k}"))
        engine.step()
        without_a += not any(s.request.tenancy.tenant == "a" for s in engine.scheduler.last_output.scheduled)
    assert 1 <= without_a <= num_steps // SOLO_STEP_PERIOD


def test_tenant_back_from_idle_banks_no_credit(make_engine):
    """A tenant that sent nothing for a while starts level with those waiting, not far below them."""
    engine = make_engine()
    busy, idle = Tenancy("busy"), Tenancy("idle")
    for i in range(40):
        engine.add_request(f"busy-{i}", prompt(i), PARAMS, tenancy=busy)
    engine.add_request("idle-0", prompt(99), PARAMS, tenancy=idle)
    for _ in range(60):
        engine.step()
    fair = engine.scheduler.fair
    for i in range(40, 60):
        engine.add_request(f"busy-{i}", prompt(i), PARAMS, tenancy=busy)
    engine.add_request("idle-1", prompt(100), PARAMS, tenancy=idle)
    assert fair.counter("idle") >= min(fair.counter("busy"), fair.counter("idle"))
    assert fair.counter("idle") >= fair.counter("busy") - 2 * max(cost(r, fair) for r in engine.requests.values())


def test_higher_priority_request_is_admitted_before_the_queue_ahead_of_it(make_engine):
    engine = make_engine(max_num_seqs=2)
    for i in range(6):
        engine.add_request(f"low-{i}", prompt(i), PARAMS)
    engine.step()
    engine.add_request("urgent", prompt(50), PARAMS, tenancy=Tenancy(priority=-1))
    admitted = admission_order(engine)
    later = admitted[admitted.index("urgent"):]
    assert all(f"low-{i}" in later for i in range(2, 6)), admitted  # every request queued ahead came after it


def test_higher_priority_request_preempts_the_lowest_newest_when_the_kv_cache_is_full(make_engine):
    # 15 blocks of 4 tokens: three 16-token prompts fill the pool with their 17th tokens.
    engine = make_engine(num_kv_blocks=15, max_num_seqs=8)
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine.add_request("old-p1", prompt(1, 16), long, tenancy=Tenancy(priority=1))
    engine.add_request("new-p1", prompt(2, 16), long, tenancy=Tenancy(priority=1))
    engine.add_request("p0", prompt(3, 16), long, tenancy=Tenancy(priority=0))
    for _ in range(2):
        engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["p0", "old-p1", "new-p1"]
    assert engine.kv.pool.num_free_blocks == 0 and engine.scheduler.num_preemptions == 0
    engine.add_request("urgent", prompt(4, 16), long, tenancy=Tenancy(priority=-1))
    engine.step()
    out = engine.scheduler.last_output
    assert [r.request_id for r in out.preempted][:1] == ["new-p1"]  # lowest priority, newest first
    assert "p0" not in {r.request_id for r in out.preempted}
    assert engine.requests["urgent"].status == RequestStatus.RUNNING
    assert engine.scheduler.running[0].request_id == "urgent"


def test_requested_priority_orders_within_one_tenant_and_equal_priorities_stay_fcfs(make_engine):
    engine = make_engine(max_num_seqs=1)
    for i, p in enumerate([0, 0, 2, 1, 0]):
        engine.add_request(f"r{i}", prompt(i), PARAMS, tenancy=Tenancy(priority=p))
    assert admission_order(engine) == ["r0", "r1", "r4", "r3", "r2"]


def test_cache_salt_separates_prefix_cache_hits(make_engine):
    engine = make_engine()
    shared = prompt(7, 40)

    def cached_tokens(request_id: str, tenancy: Tenancy) -> int:
        engine.add_request(request_id, shared, PARAMS, tenancy=tenancy)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    cached = out.num_cached_tokens
        return cached

    assert cached_tokens("a-1", Tenancy("a", cache_salt="a")) == 0
    assert cached_tokens("b-1", Tenancy("b", cache_salt="b")) == 0  # another salt sees nothing of a's
    assert cached_tokens("a-2", Tenancy("a", cache_salt="a")) == 36  # its own salt hits (last block recomputed)
    assert cached_tokens("anon", Tenancy()) == 0  # no salt: not a's either


def test_full_waiting_queue_still_takes_one_request_of_a_tenant_with_nothing_queued(make_engine):
    import asyncio

    from engine import AsyncEngine, EngineOverloadedError

    core = make_engine(max_num_seqs=1, max_num_waiting=2)
    engine = AsyncEngine(core.config, engine=core)
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    flood = Tenancy("flood")

    async def drain(stream) -> None:
        async for _ in stream:
            pass

    async def main() -> None:
        tasks = [asyncio.create_task(drain(engine.generate(prompt(0), long, tenancy=flood)))]
        for _ in range(100):
            await asyncio.sleep(0.01)
            if engine.stats().num_running:
                break
        tasks += [asyncio.create_task(drain(engine.generate(prompt(i), long, tenancy=flood))) for i in (1, 2)]
        await asyncio.sleep(0.1)
        assert engine.num_waiting == 2 and not engine.has_room(1, "flood")
        with pytest.raises(EngineOverloadedError):
            await drain(engine.generate(prompt(9), long, tenancy=flood))
        assert engine.has_room(1, "quiet")
        quiet = asyncio.create_task(drain(engine.generate(prompt(10), long, tenancy=Tenancy("quiet"))))
        await asyncio.sleep(0)  # queued: a slot frees only when the running request's 400 tokens are done
        assert not engine.has_room(1, "quiet")  # one each: its next one waits like everyone's
        for task in tasks:
            task.cancel()
        await asyncio.gather(quiet, *tasks, return_exceptions=True)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
