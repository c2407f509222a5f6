"""A TTFT objective in the scheduler (a tiny random Llama): requests that waited past it without a first token go
behind those that can still meet it; priorities still come first, a request that had its first token keeps its
place, and every request still finishes."""
from __future__ import annotations

import time

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.request import Request
from engine.tenancy import FairShare, Tenancy, WaitingQueue
from tests.tiny_models import tiny_engine, tiny_llama_source

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    return tiny_llama_source(tmp_path_factory.mktemp("tiny-llama"))


def make_engine(tiny_source, **overrides) -> LLMEngine:
    config = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=32, max_num_seqs=2, prepack_weights=False,
                  num_threads=1)
    return tiny_engine(tiny_source, **{**config, **overrides})


def prompt(i: int) -> list[int]:
    return [(i * 31 + k * 7) % 500 + 3 for k in range(12)]


def run_to_end(engine: LLMEngine) -> tuple[list[str], set[str]]:
    """Steps until every request finished: the ids in the order they first ran, and those that finished."""
    order: list[str] = []
    finished: set[str] = set()
    for _ in range(300):
        finished |= {out.request_id for out in engine.step() if out.finished}
        order += [r.request_id for r in engine.scheduler.running if r.request_id not in order]
        if not engine.has_unfinished():
            break
    return order, finished


def add_mixed(engine: LLMEngine, tenancy_of=lambda i: Tenancy()) -> list[str]:
    """Four requests that arrived 5 s ago (late for a 2 s objective), then four that arrive now."""
    now = time.time()
    ids = []
    for i in range(8):
        ids.append(f"{'late' if i < 4 else 'fresh'}-{i}")
        engine.add_request(ids[-1], prompt(i), PARAMS, arrival_time=now - 5 if i < 4 else now,
                           tenancy=tenancy_of(i))
    return ids


def test_without_an_objective_requests_run_in_arrival_order(tiny_source):
    engine = make_engine(tiny_source)
    ids = add_mixed(engine)
    order, finished = run_to_end(engine)
    assert order == ids and finished == set(ids)


def test_requests_past_the_objective_yield_to_those_that_can_still_meet_it(tiny_source):
    engine = make_engine(tiny_source, ttft_objective_s=2.0)
    ids = add_mixed(engine)
    engine.step()
    assert engine.stats().num_waiting_late == 4 and engine.stats().num_waiting == 6  # two of the fresh run
    order, finished = run_to_end(engine)
    assert order == ids[4:] + ids[:4], order  # on time first, each group in arrival order
    assert engine.stats().num_waiting_late == 0
    assert finished == set(ids)  # the late ones are served once no request on time waits
    # A fresh request that waits past the objective becomes late too: nothing else is waiting, so it runs.
    engine.add_request("alone", prompt(9), PARAMS, arrival_time=time.time() - 10)
    order, finished = run_to_end(engine)
    assert order == ["alone"] and finished == {"alone"}


def test_priority_comes_before_lateness(tiny_source):
    engine = make_engine(tiny_source, ttft_objective_s=2.0)
    # The late ones have priority 0, the fresh ones 1: priority wins, lateness orders within a priority.
    ids = add_mixed(engine, lambda i: Tenancy(priority=0 if i < 4 else 1))
    order, _ = run_to_end(engine)
    assert order == ids


def test_a_request_with_its_first_token_is_never_late_and_the_tenants_counts_hold():
    block = 4
    now = time.time()

    def request(name: str, arrival: float, tenant: str = "") -> Request:
        return Request(name, [5, 6, 7], PARAMS, block, arrival_time=arrival, tenancy=Tenancy(tenant))

    queue = WaitingQueue(FairShare(), late_after_s=2.0)
    started = request("started", now - 30)
    started.append_output_token(9)  # preempted after its first token: back at the head
    queue.append(old := request("old", now - 10))
    queue.append(fresh := request("fresh", now))
    queue.append(other := request("other-tenant-old", now - 10, "b"))
    queue.appendleft(started)
    counts = (len(queue), queue.count(""), queue.count("b"))
    assert queue.demote_late(now) == 2
    assert (len(queue), queue.count(""), queue.count("b")) == counts
    assert old.late and other.late and not started.late and not fresh.late
    assert list(queue)[:2] == [started, fresh] and set(list(queue)[2:]) == {old, other}
    assert queue.demote_late(now) == 0  # already in the late band
    queue.remove(old)
    assert not old.late and len(queue) == 3
    assert WaitingQueue(FairShare()).demote_late(now) == 0  # no objective: nothing moves


def test_the_objective_is_validated():
    with pytest.raises(ValueError, match="ttft_objective_s"):
        EngineConfig(model="m", ttft_objective_s=0)


def test_the_slo_policy_hands_its_ttft_to_the_engines_unless_one_is_set():
    from deployments.config import AppArgs

    slo = {"enabled": True, "policy": "slo", "slo": {"ttft_s": 1.5}}
    assert AppArgs(model="/m.gguf").engine_config().ttft_objective_s is None
    assert AppArgs(model="/m.gguf", autoscaling=slo).engine_config().ttft_objective_s == 1.5
    assert AppArgs(model="/m.gguf", autoscaling={**slo, "policy": "queue_kv"}).engine_config().ttft_objective_s is None
    explicit = AppArgs(model="/m.gguf", autoscaling=slo, engine={"ttft_objective_s": 4})
    assert explicit.engine_config().ttft_objective_s == 4
