"""The routing decision itself, free of Ray: replica reports and live load in, replicas best-first out.

Each candidate scores ``prefix_weight * cached share of the prompt + queue_weight * (1 - wait / (max wait + 1 s))
+ kv_weight * (1 - KV usage)`` (llm-d's three scorers). The wait is the replica's predicted wait in seconds: the
backlog it last reported (engine.backlog: how long before a new request could start there), plus the requests
sent to it since, each at that backlog's cost per request (a second each on a replica that reported none). So
among replicas holding as much of the prompt, the one that would start it soonest wins. While no replica is a
second behind (every one can start a request now), or some replica has no estimate yet, requests stand in for
seconds: ``1 - load / (max load + 1)``, load being ongoing requests. The load guard comes first: when loads are
too uneven (SGLang's absolute and relative thresholds) the least-loaded replica wins whatever it caches.
"""
from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from deployments.block_digest import longest_cached_prefix, probe_positions
from deployments.router_config import RouterSettings


@dataclass(frozen=True)
class ReplicaReport:
    """The part of a replica's routing stats (a ReplicaStats as a dict) that routing reads."""

    num_running: int
    num_waiting: int
    kv_usage: float
    block_size: int
    reported_at: float
    cached_block_digest: bytes
    backlog_s: float | None = None  # None: the replica cannot estimate it yet
    num_active_streams: int = 0  # generate calls inside the replica: every request it holds, queued or not

    @classmethod
    def from_routing_stats(cls, stats: Mapping[str, Any] | None) -> "ReplicaReport | None":
        """None for a replica that has not reported yet (Serve hands an empty dict) or reports something else."""
        if not stats:
            return None
        try:
            backlog = stats.get("backlog_s")
            return cls(int(stats["num_running"]), int(stats["num_waiting"]), float(stats["kv_usage"]),
                       int(stats.get("block_size", 0)), float(stats.get("reported_at", 0.0)),
                       bytes(stats.get("cached_block_digest", b"")), None if backlog is None else float(backlog),
                       int(stats.get("num_active_streams", 0)))
        except (KeyError, TypeError, ValueError):
            return None

    def is_fresh(self, now: float, stale_after_s: float) -> bool:
        return now - self.reported_at <= stale_after_s

    @property
    def num_held(self) -> int:
        """Requests the replica held when it reported: an upper bound on those sent to it earlier still there."""
        return max(self.num_running + self.num_waiting, self.num_active_streams)


@dataclass(frozen=True)
class Candidate:
    replica: str
    load: float  # ongoing requests
    kv_usage: float
    cached_blocks: int  # expected leading prompt blocks already cached there
    wait_s: float | None = None  # predicted wait before a new request starts there; None: unknown


@dataclass(frozen=True)
class RoutingDecision:
    order: list[str]  # best first
    guarded: bool  # the load guard overrode cache affinity
    expected_cached_blocks: int  # on the first replica


class PromptProbes:
    """A prompt's block hashes and their Bloom probe positions, computed once per filter size."""

    def __init__(self, block_hashes: list[int]) -> None:
        self.block_hashes = block_hashes
        self._positions: dict[int, np.ndarray] = {}

    def cached_blocks(self, digest: bytes) -> int:
        if not digest or not self.block_hashes:
            return 0
        num_bits = len(digest) * 8
        if num_bits not in self._positions:
            self._positions[num_bits] = probe_positions(self.block_hashes, num_bits)
        return longest_cached_prefix(digest, self._positions[num_bits])


# A request sent to a replica that reported none in flight: counted as this much work until its next report.
UNKNOWN_REQUEST_S = 1.0


def make_candidate(replica: str, report: ReplicaReport | None, live_load: int | None, probes: PromptProbes,
                   remembered_blocks: int, now: float, settings: RouterSettings) -> Candidate:
    """A stale or missing report says nothing about the cache or KV usage; load then comes from Serve alone."""
    fresh = report is not None and report.is_fresh(now, settings.stale_after_s)
    reported_blocks = 0
    if fresh and report.block_size == settings.block_size:
        reported_blocks = probes.cached_blocks(report.cached_block_digest)
    reported_load = report.num_running + report.num_waiting if fresh else 0
    if live_load is not None:
        load = float(live_load)
    elif fresh:
        load = float(reported_load)
    else:
        load = 0.0
    wait_s = None
    if fresh and report.backlog_s is not None:
        # Requests sent since the report add what each of the reported ones costs on average.
        per_request_s = report.backlog_s / reported_load if reported_load else UNKNOWN_REQUEST_S
        wait_s = report.backlog_s + max(load - reported_load, 0.0) * per_request_s
    return Candidate(replica, load, report.kv_usage if fresh else 0.0, max(reported_blocks, remembered_blocks),
                     wait_s)


def is_imbalanced(loads: list[float], abs_threshold: float, rel_threshold: float) -> bool:
    if len(loads) < 2:
        return False
    high, low = max(loads), min(loads)
    return high - low > abs_threshold and high > low * rel_threshold


WAIT_SCALE_S = 1.0  # waits well under a second apart count as about equal


def queue_terms(candidates: list[Candidate]) -> dict[str, float]:
    """Each replica's queue term in [0, 1]: by predicted wait when every replica has one and some replica is
    behind by a second or more; else (all can start a request now, or some cannot say) by load."""
    if all(c.wait_s is not None for c in candidates) and max(c.wait_s for c in candidates) >= WAIT_SCALE_S:
        max_wait = max(c.wait_s for c in candidates)
        return {c.replica: 1.0 - c.wait_s / (max_wait + WAIT_SCALE_S) for c in candidates}
    max_load = max(c.load for c in candidates)
    return {c.replica: 1.0 - c.load / (max_load + 1.0) for c in candidates}


def score(candidate: Candidate, num_prompt_blocks: int, queue_term: float, settings: RouterSettings) -> float:
    cached_share = candidate.cached_blocks / num_prompt_blocks if num_prompt_blocks else 0.0
    return (settings.prefix_weight * cached_share + settings.queue_weight * queue_term
            + settings.kv_weight * (1.0 - candidate.kv_usage))


def rank(candidates: list[Candidate], num_prompt_blocks: int, settings: RouterSettings,
         rng: random.Random | None = None) -> RoutingDecision:
    if not candidates:
        return RoutingDecision([], False, 0)
    rng = rng or random.Random()
    jitter = {c.replica: rng.random() for c in candidates}  # exact ties go either way, not always to the first
    loads = [c.load for c in candidates]
    if is_imbalanced(loads, settings.balance_abs_threshold, settings.balance_rel_threshold):
        ordered = sorted(candidates, key=lambda c: (c.load, -c.cached_blocks, jitter[c.replica]))
        return RoutingDecision([c.replica for c in ordered], True, ordered[0].cached_blocks)
    queue = queue_terms(candidates)
    ordered = sorted(candidates, key=lambda c: (-score(c, num_prompt_blocks, queue[c.replica], settings),
                                                -queue[c.replica], c.load, jitter[c.replica]))
    return RoutingDecision([c.replica for c in ordered], False, ordered[0].cached_blocks)
