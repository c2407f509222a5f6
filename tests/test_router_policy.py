"""Prefix-aware routing without Ray: replica reports as the engine replicas send them, in; replicas best-first, out."""
from __future__ import annotations

import dataclasses
import random
import time

import numpy as np
import pytest

from deployments.block_digest import (build_digest, digest_num_bits, longest_cached_prefix, probe_positions,
                                      with_block_digest)
from deployments.records import ReplicaStats
from deployments.routed_memory import RoutedPrefixMemory
from deployments.router_config import RouterSettings
from deployments.routing_policy import PromptProbes, ReplicaReport, is_imbalanced, make_candidate, rank
from engine.block_pool import BlockPool
from engine.hashing import hash_block_chain

BLOCK = 16
NUM_BITS = digest_num_bits(384, 10, 1 << 20)
SETTINGS = RouterSettings(block_size=BLOCK)


def prompt(seed: int, num_tokens: int = 40 * BLOCK) -> list[int]:
    return random.Random(seed).choices(range(49152), k=num_tokens)


def routing_stats(cached_token_lists: list[list[int]], num_running: int = 0, kv_usage: float = 0.2,
                  age_s: float = 0.0, backlog_s: float | None = None) -> dict:
    """What record_routing_stats returns for a replica whose cache holds the full blocks of these token lists."""
    hashes = [h for tokens in cached_token_lists for h in hash_block_chain(tokens, BLOCK)]
    stats = ReplicaStats(replica_id="r", num_running=num_running, num_waiting=0, kv_usage=kv_usage,
                         num_kv_blocks=384, num_free_kv_blocks=300, num_used_kv_blocks=84, prefix_cache_queries=0,
                         prefix_cache_hits=0, num_preemptions=0, num_finished_requests=0, num_active_streams=0,
                         backlog_s=backlog_s, block_size=BLOCK, reported_at=time.time() - age_s,
                         cached_block_digest=build_digest(hashes, NUM_BITS))
    return dataclasses.asdict(stats)


def decide(tokens: list[int], stats_by_replica: dict[str, dict], live_load: dict[str, int | None],
           settings: RouterSettings = SETTINGS, memory: RoutedPrefixMemory | None = None):
    probes = PromptProbes(hash_block_chain(tokens[:-1], BLOCK))
    now = time.time()
    candidates = [make_candidate(name, ReplicaReport.from_routing_stats(stats), live_load.get(name), probes,
                                 memory.longest_prefix(name, probes.block_hashes, now) if memory else 0, now, settings)
                  for name, stats in stats_by_replica.items()]
    return rank(candidates, len(probes.block_hashes), settings, random.Random(0))


def test_longest_cached_prefix_wins_at_equal_load():
    request = prompt(1)
    stats = {"short": routing_stats([request[:8 * BLOCK]]),
             "long": routing_stats([request[:30 * BLOCK]]),
             "other": routing_stats([prompt(2)]),
             "empty": routing_stats([])}
    for _ in range(5):
        decision = decide(request, stats, {name: 3 for name in stats})
        assert decision.order[:2] == ["long", "short"]
        assert decision.expected_cached_blocks == 30
        assert not decision.guarded


def test_cache_affinity_outweighs_a_small_load_difference_but_not_a_larger_one():
    request = prompt(3)
    stats = {"holder": routing_stats([request[:36 * BLOCK]]), "idle": routing_stats([])}
    assert decide(request, stats, {"holder": 4, "idle": 2}).order[0] == "holder"
    # A prompt barely cached is not worth a queue.
    stats = {"holder": routing_stats([request[:4 * BLOCK]]), "idle": routing_stats([])}
    assert decide(request, stats, {"holder": 4, "idle": 2}).order[0] == "idle"


@pytest.mark.parametrize("holder_load, idle_load, guarded", [
    (10, 2, False),  # difference 8: not above the absolute threshold
    (11, 2, True),
    (30, 20, False),  # difference 10, but 30 is not above 1.5 * 20
    (31, 20, True),
])
def test_load_guard_overrides_affinity_past_both_thresholds(holder_load, idle_load, guarded):
    request = prompt(4)
    stats = {"holder": routing_stats([request]), "idle": routing_stats([])}
    decision = decide(request, stats, {"holder": holder_load, "idle": idle_load})
    assert decision.guarded is guarded
    assert decision.order[0] == ("idle" if guarded else "holder")
    assert is_imbalanced([holder_load, idle_load], 8, 1.5) is guarded


def test_empty_or_stale_report_falls_back_to_load():
    request = prompt(5)
    # A replica that has not reported yet: Serve hands the router an empty dict.
    assert decide(request, {"a": {}, "b": {}}, {"a": 3, "b": 1}).order == ["b", "a"]
    assert decide(request, {"a": {}, "b": {}}, {"a": 1, "b": 3}).order == ["a", "b"]
    # A stale report claiming the whole prompt counts for nothing; nor does its KV usage.
    stale = routing_stats([request], kv_usage=0.0, age_s=SETTINGS.stale_after_s + 5)
    fresh_empty = routing_stats([], kv_usage=0.0)
    decision = decide(request, {"stale": stale, "fresh": fresh_empty}, {"stale": 3, "fresh": 1})
    assert decision.order == ["fresh", "stale"] and decision.expected_cached_blocks == 0
    # The same report, fresh, wins at that load.
    fresh = routing_stats([request], kv_usage=0.0)
    assert decide(request, {"holder": fresh, "fresh": fresh_empty}, {"holder": 3, "fresh": 1}).order[0] == "holder"


def test_among_replicas_holding_the_prefix_the_least_predicted_wait_wins():
    request = prompt(16)
    # Equal request counts, unequal work: the replica whose requests are long is behind by seconds.
    stats = {"slow": routing_stats([request], num_running=4, backlog_s=12.0),
             "fast": routing_stats([request], num_running=4, backlog_s=1.0),
             "none": routing_stats([], num_running=0, backlog_s=0.0)}
    assert decide(request, stats, {"slow": 4, "fast": 4, "none": 0}).order[:2] == ["fast", "slow"]
    # Requests sent since the report count at the reported cost per request: 4 more on "fast" is 1 s more.
    even = {"a": routing_stats([request], num_running=4, backlog_s=4.0),
            "b": routing_stats([request], num_running=4, backlog_s=4.0)}
    assert decide(request, even, {"a": 8, "b": 5}).order[0] == "b"
    # A burst onto idle replicas spreads: each request sent since the reports counts, whatever the KV usage says.
    idle = {"a": routing_stats([], kv_usage=0.0, backlog_s=0.0), "b": routing_stats([], kv_usage=0.05, backlog_s=0.0)}
    assert decide(request, idle, {"a": 1, "b": 0}).order[0] == "b"
    assert decide(request, idle, {"a": 1, "b": 1}).order[0] == "a"
    # Nobody a second behind (free slots everywhere): load decides, as it does without estimates.
    busy_free = {"a": routing_stats([], num_running=2, kv_usage=0.0, backlog_s=0.2),
                 "b": routing_stats([], num_running=2, kv_usage=0.1, backlog_s=0.0)}
    assert decide(request, busy_free, {"a": 4, "b": 2}).order[0] == "b"
    # A replica with no estimate yet: requests stand in for seconds for every replica.
    unknown = {"slow": routing_stats([request], num_running=2, backlog_s=30.0),
               "new": routing_stats([request], num_running=3)}
    assert decide(request, unknown, {"slow": 2, "new": 3}).order[0] == "slow"


def test_reported_load_stands_in_when_serve_has_no_live_count():
    request = prompt(6)
    stats = {"busy": routing_stats([], num_running=5), "quiet": routing_stats([], num_running=1)}
    assert decide(request, stats, {"busy": None, "quiet": None}).order[0] == "quiet"


def test_a_burst_with_one_new_prefix_follows_the_first_request():
    shared = prompt(7, 32 * BLOCK)
    memory = RoutedPrefixMemory(ttl_s=5.0, max_blocks=1000)
    stats = {"a": routing_stats([]), "b": routing_stats([])}
    first = decide(shared + prompt(8, 4 * BLOCK), stats, {"a": 0, "b": 0}, memory=memory).order[0]
    memory.remember(first, hash_block_chain(shared, BLOCK), time.time())
    for seed in range(9, 15):
        # Its own request now loads the first replica by one; the remembered prefix outweighs that.
        load = {"a": 1, "b": 0} if first == "a" else {"a": 0, "b": 1}
        assert decide(shared + prompt(seed, 4 * BLOCK), stats, load, memory=memory).order[0] == first


def test_routed_memory_expires_and_stays_bounded():
    memory = RoutedPrefixMemory(ttl_s=2.0, max_blocks=10)
    hashes = hash_block_chain(prompt(20, 8 * BLOCK), BLOCK)
    memory.remember("a", hashes, now=100.0)
    assert memory.longest_prefix("a", hashes, now=101.0) == 8
    assert memory.longest_prefix("a", hashes, now=102.5) == 0
    memory.remember("a", hash_block_chain(prompt(21, 30 * BLOCK), BLOCK), now=200.0)
    assert memory.num_blocks("a") == 10
    memory.keep_only(["b"])
    assert memory.num_blocks("a") == 0


def test_digest_finds_every_cached_prefix_and_stops_at_the_first_gap():
    pool = BlockPool(4096)
    chains = [hash_block_chain(prompt(seed, 64 * BLOCK), BLOCK) for seed in range(40)]
    for i, chain in enumerate(chains[:30]):
        for j, block_hash in enumerate(chain):
            pool.cached[block_hash] = i * 64 + j
    num_bits = digest_num_bits(4096, 10, 1 << 20)
    digest = build_digest(pool.cached_hashes(), num_bits)
    assert len(digest) * 8 == num_bits == 65536
    assert all(longest_cached_prefix(digest, probe_positions(c, num_bits)) == 64 for c in chains[:30])
    # A block missing in the middle (evicted) ends the prefix there.
    gap = chains[0][:10] + chains[35][10:20] + chains[0][20:]
    assert longest_cached_prefix(digest, probe_positions(gap, num_bits)) == 10
    misses = [longest_cached_prefix(digest, probe_positions(c, num_bits)) for c in chains[30:]]
    assert sum(misses) <= 1  # about 0.7% of uncached first blocks pass the filter


def test_digest_size_is_fixed_by_the_pool_and_capped():
    assert digest_num_bits(100_000, 10, 1 << 20) == 1 << 20  # 128 KiB at 100k blocks
    assert digest_num_bits(100_000, 10, 64 << 10) == 64 << 13  # the cap wins
    rng = np.random.default_rng(0)
    sizes = {len(build_digest(rng.integers(0, 2**63, size=n, dtype=np.uint64), NUM_BITS)) for n in (0, 10, 3000)}
    assert sizes == {NUM_BITS // 8}


def test_replica_report_round_trips_through_replica_stats():
    pool = BlockPool(64)
    tokens = prompt(30, 6 * BLOCK)
    for i, block_hash in enumerate(hash_block_chain(tokens, BLOCK)):
        pool.cached[block_hash] = i
    base = ReplicaStats(replica_id="r", num_running=2, num_waiting=1, kv_usage=0.5, num_kv_blocks=64,
                        num_free_kv_blocks=32, num_used_kv_blocks=32, prefix_cache_queries=0, prefix_cache_hits=0,
                        num_preemptions=0, num_finished_requests=0, num_active_streams=2)
    stats = dataclasses.asdict(with_block_digest(base, pool.cached_hashes(), BLOCK, digest_num_bits(64, 10, 1 << 20)))
    assert ReplicaStats(**stats).num_running == 2  # the test fixture's reading of the same dict still works
    report = ReplicaReport.from_routing_stats(stats)
    assert report is not None and report.is_fresh(time.time(), 5.0)
    assert PromptProbes(hash_block_chain(tokens, BLOCK)).cached_blocks(report.cached_block_digest) == 6
    assert report.backlog_s is None  # no estimate in this report
    assert ReplicaReport.from_routing_stats({**stats, "backlog_s": 2.5}).backlog_s == 2.5
    assert ReplicaReport.from_routing_stats({}) is None
    assert ReplicaReport.from_routing_stats({"something": "else"}) is None


# --- PrefixAwareRouter's own in-flight count, driven as Serve's router drives it ---------------------------------

class _Replica:
    """What choose_replicas reads of a Serve RunningReplica: its id and its last routing stats."""

    def __init__(self, unique_id: str) -> None:
        from ray.serve._private.common import DeploymentID, ReplicaID
        self.replica_id = ReplicaID(unique_id, DeploymentID(name="engine", app_name="tokenline"))
        self.routing_stats: dict = {}


def _router_and_replicas():
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from deployments.router import PrefixAwareRouter
    router = PrefixAwareRouter(DeploymentID(name="engine", app_name="tokenline"), DeploymentHandleSource.UNKNOWN,
                               use_replica_queue_len_cache=True)
    return router, [_Replica("a"), _Replica("b")]


def _pending(i: int):
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest
    return PendingRequest(args=[], kwargs={}, metadata=RequestMetadata(f"r{i}", f"internal-{i}"))


async def _served_one_at_a_time(router, replicas, ids) -> set[str]:
    """The replicas that requests sent one after another (each completed before the next) were routed to."""
    served = set()
    for i in ids:
        chosen = (await router.choose_replicas(replicas, _pending(i)))[0][0]
        served.add(chosen.replica_id.unique_id)
        router.on_request_completed(chosen.replica_id, f"internal-{i}")
    return served


def test_router_counts_a_request_until_it_completes_and_forgets_one_never_sent():
    import asyncio

    import deployments.router as router_module

    async def scenario():
        router, replicas = _router_and_replicas()
        # Accepted by "a": counted until Serve reports it complete, however long that takes.
        accepted = _pending(0)
        first = (await router.choose_replicas(replicas, accepted))[0][0]
        accepted.future.set_result(first)
        router.on_request_routed(accepted, first.replica_id, None)
        # Given a replica, then cancelled before it was sent: Serve never calls on_request_completed for it.
        lost = _pending(1)
        second = (await router.choose_replicas(replicas, lost))[0][0]
        assert second.replica_id != first.replica_id  # the burst spreads: "a" already has one
        lost.future.set_result(second)
        assert router._in_flight_by_replica({}, time.time()) == {first.replica_id.unique_id: 1, second.replica_id.unique_id: 1}
        for routed in router._in_flight.values():  # its grace passes (the accepted one has none to pass)
            routed.chosen_at -= router_module.UNSENT_GRACE_S + 1
        assert router._in_flight_by_replica({}, time.time()) == {first.replica_id.unique_id: 1}  # the lost one no longer counts
        # With one request still running on the first replica, idle traffic goes to the other, every time.
        for i in range(2, 8):
            chosen = (await router.choose_replicas(replicas, _pending(i)))[0][0]
            assert chosen.replica_id == second.replica_id
            router.on_request_completed(chosen.replica_id, f"internal-{i}")
        router.on_request_completed(first.replica_id, "internal-0")
        assert router._in_flight_by_replica({}, time.time()) == {}
        # Nothing in flight anywhere: sequential requests reach both replicas.
        assert await _served_one_at_a_time(router, replicas, range(8, 40)) == {"a", "b"}

    asyncio.run(scenario())


def _report(num_held: int, reported_at: float) -> dict:
    return {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0, "num_active_streams": num_held,
            "reported_at": reported_at}


def test_router_stops_counting_an_accepted_request_its_replica_reports_it_no_longer_holds():
    import asyncio

    from deployments.router import REPORT_SETTLE_S

    async def scenario():
        router, replicas = _router_and_replicas()
        a = replicas[0]
        # Two requests "a" accepted whose completions never reach this router (a lost callback).
        for i in range(2):
            pending = _pending(i)
            chosen = (await router.choose_replicas([a], pending))[0][0]
            pending.future.set_result(chosen)
            router.on_request_routed(pending, chosen.replica_id, None)
        accepted_at = time.time()
        # A report from before they had settled proves nothing; one that says "a" still holds both keeps them.
        for stats in (_report(0, accepted_at), _report(2, accepted_at + REPORT_SETTLE_S + 0.5)):
            a.routing_stats = stats
            assert router._in_flight_by_replica({"a": ReplicaReport.from_routing_stats(stats)},
                                                accepted_at + REPORT_SETTLE_S + 1) == {"a": 2}
        # "a" reports holding one, then none: the oldest goes first, then the other.
        for held in (1, 0):
            stats = _report(held, accepted_at + REPORT_SETTLE_S + 0.5)
            assert router._in_flight_by_replica({"a": ReplicaReport.from_routing_stats(stats)},
                                                accepted_at + REPORT_SETTLE_S + 1) == ({"a": 1} if held else {})
        assert len(router._in_flight) == 0
        # And with it gone, idle traffic reaches both replicas again.
        for replica in replicas:
            replica.routing_stats = _report(0, time.time())
        assert await _served_one_at_a_time(router, replicas, range(2, 34)) == {"a", "b"}

    asyncio.run(scenario())


def test_serve_count_older_than_a_replica_report_is_corrected_by_it():
    import asyncio

    from deployments.router import REPORT_SETTLE_S

    async def scenario():
        router, replicas = _router_and_replicas()
        a, b = replicas
        # Serve's cached count for "b" kept +2 for requests cancelled between being sent and being accepted.
        pending = _pending(0)
        chosen = (await router.choose_replicas([b], pending))[0][0]
        router.on_request_completed(chosen.replica_id, "internal-0")
        router.replica_queue_len_cache.update(b.replica_id, 2)
        router.replica_queue_len_cache.update(a.replica_id, 0)
        # A report from just after that send says nothing yet: Serve's count stands.
        a.routing_stats = b.routing_stats = _report(0, time.time())
        await router.choose_replicas(replicas, _pending(1))
        router.on_request_completed(a.replica_id, "internal-1")
        assert router.replica_queue_len_cache.get(b.replica_id) == 2
        # Reports newer than the last send to "b": its count becomes what it reported, and idle traffic spreads.
        router._last_chosen = {key: t - 2 * REPORT_SETTLE_S for key, t in router._last_chosen.items()}
        served = set()
        for i in range(2, 34):
            a.routing_stats = b.routing_stats = _report(0, time.time())
            router._last_chosen = {key: t - 2 * REPORT_SETTLE_S for key, t in router._last_chosen.items()}
            chosen = (await router.choose_replicas(replicas, _pending(i)))[0][0]
            served.add(chosen.replica_id.unique_id)
            router.on_request_completed(chosen.replica_id, f"internal-{i}")
        assert router.replica_queue_len_cache.get(b.replica_id) == 0
        assert served == {"a", "b"}

    asyncio.run(scenario())
