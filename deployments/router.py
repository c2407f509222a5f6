"""PrefixAwareRouter: Ray Serve's RequestRouter for engine replicas, sending each prompt where its prefix is cached.

Configured through the engine deployment's `request_router_config` (see deployments/app.py). Per request it:
1. hashes the prompt's full blocks with the engine's own chained hash (the ingress already tokenized it, and the
   token ids travel in the EngineRequest that is `generate`'s argument);
2. reads what each replica last reported through `record_routing_stats` (load, KV usage, a Bloom digest of its
   cached block hashes; Serve's controller polls them every `stats_period_s` and pushes them to this router),
   the live ongoing-request count Serve keeps per replica, and what this router itself routed there lately;
3. ranks the replicas (deployments/routing_policy.py) and returns one rank per replica, best first, so Serve
   falls through to the next when one is full.
Nothing here awaits: routing reads only state already in this process.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.config import AppArgs
from deployments.lru import BoundedLRU
from deployments.records import EngineRequest
from deployments.routed_memory import RoutedPrefixMemory
from deployments.router_config import RouterSettings
from deployments.routing_policy import PromptProbes, ReplicaReport, make_candidate, rank
from deployments.timeline import RoutingNote, note_routing
from engine.hashing import hash_block_chain, root_hash

log = logging.getLogger(__name__)

MAX_REQUESTS_IN_FLIGHT = 4096  # a bound on this router's bookkeeping, far above any replica's queue
# A request given a replica is sent within milliseconds; one still not accepted this long after is either counted by
# Serve already (it increments its count on send) or was cancelled between being given a replica and being sent, a
# path on which Serve never calls on_request_completed. Past this it no longer adds to the replica's load.
UNSENT_GRACE_S = 10.0
# A request sent to a replica this long before one of its reports was inside it by then. When the report says the
# replica held fewer requests than this router still counts there from before it, the oldest of those are gone (a
# completion this router was never told of) and stop counting; and Serve's cached ongoing count for a replica this
# router sent nothing to since the report, older than the report, is set to what it says. Serve's count otherwise
# keeps +1 for each request cancelled between being sent and accepted until it goes stale (10 s), the replica
# losing every tie at idle meanwhile.
REPORT_SETTLE_S = 1.0


@dataclass
class InFlight:
    replica: str
    probes: PromptProbes
    future: asyncio.Future
    chosen_at: float  # time.time()
    accepted_at: float | None = None  # time.time() when the replica took it (Serve's completion callback is set)

    def counts(self, now: float) -> bool:
        return self.accepted_at is not None or not self.future.done() or now - self.chosen_at < UNSENT_GRACE_S


class PrefixAwareRouter(RequestRouter):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initialize_state()

    def initialize_state(self, **kwargs: Any) -> None:
        """Serve calls this with the deployment's `request_router_kwargs` (a RouterSettings as JSON)."""
        self.settings = RouterSettings.model_validate(kwargs)
        self.memory = RoutedPrefixMemory(self.settings.routed_memory_s, self.settings.routed_memory_max_blocks)
        # Requests chosen for and not yet finished, by internal request id: this router's own in-flight count.
        self._in_flight: BoundedLRU[str, InFlight] = BoundedLRU(MAX_REQUESTS_IN_FLIGHT)
        self._last_chosen: dict[str, float] = {}  # time.time() this router last gave each replica a request
        self._rng = random.Random()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        probes = self._prompt_probes(pending_request)
        now = time.time()
        reports = {r.replica_id.unique_id: ReplicaReport.from_routing_stats(r.routing_stats)
                   for r in candidate_replicas}
        in_flight = self._in_flight_by_replica(reports, now)
        self._refresh_serve_counts(candidate_replicas, reports, now)
        candidates = [
            make_candidate(r.replica_id.unique_id, reports[r.replica_id.unique_id],
                           self._live_load(r, in_flight), probes,
                           self.memory.longest_prefix(r.replica_id.unique_id, probes.block_hashes, now),
                           now, self.settings)
            for r in candidate_replicas]
        decision = rank(candidates, len(probes.block_hashes), self.settings, self._rng)
        order = _avoiding(decision.order, _avoided_replicas(pending_request))
        by_key = {r.replica_id.unique_id: r for r in candidate_replicas}
        if pending_request is not None:
            # Every replica is ranked on each pass: when all are full, Serve should back off, not spin.
            pending_request.routing_context.should_backoff = True
            # Counted and remembered now, not once the replica accepts: a burst routed meanwhile must see it.
            self.memory.remember(order[0], probes.block_hashes, now)
            self._track(pending_request, order[0], probes)
            self._note(pending_request, order[0], decision.expected_cached_blocks if order[0] == decision.order[0]
                       else 0)
        log.debug("routing %d prompt blocks: %s (guard %s, expected cached blocks %d)", len(probes.block_hashes),
                  order, decision.guarded, decision.expected_cached_blocks)
        return [[by_key[key]] for key in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Serve calls this once a replica accepted the request."""
        routed = self._in_flight.get(pending_request.metadata.internal_request_id)
        if routed is None:
            return
        routed.accepted_at = time.time()
        if routed.replica != replica_id.unique_id:  # the first choice was full
            routed.replica = replica_id.unique_id
            self._last_chosen[routed.replica] = time.time()
            self.memory.remember(routed.replica, routed.probes.block_hashes, time.time())
            self._note(pending_request, routed.replica, 0)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._in_flight.pop(internal_request_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.memory.keep_only(r.replica_id.unique_id for r in replicas)
        current = {r.replica_id.unique_id for r in replicas}
        self._last_chosen = {k: t for k, t in self._last_chosen.items() if k in current}

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.memory.forget(replica_id.unique_id)

    def _prompt_probes(self, pending_request: PendingRequest | None) -> PromptProbes:
        """The engine can reuse at most (len - 1) // block_size blocks: the last token is always recomputed."""
        if pending_request is None:
            return PromptProbes([])
        routed = self._in_flight.get(pending_request.metadata.internal_request_id)
        if routed is not None:  # a retry after every replica was full: hashed already
            return routed.probes
        request = _engine_request(pending_request)
        if request is None:  # model_info, stats: no prompt, so load alone decides
            return PromptProbes([])
        # Salted as the engine salts them: a tenant's prompt matches only its own tenant's cached blocks.
        return PromptProbes(hash_block_chain(request.prompt_token_ids[:-1], self.settings.block_size,
                                             parent_hash=root_hash(request.tenancy.cache_salt)))

    def _note(self, pending_request: PendingRequest, replica: str, expected_cached_blocks: int) -> None:
        """The decision, for the request's timeline (read by the ingress in this same process).

        Through a function of deployments.timeline, never a module-level object: Serve pickles this module by
        value, which would give the router its own copy of any object it names."""
        request = _engine_request(pending_request)
        if request is not None:
            expected_tokens = expected_cached_blocks * self.settings.block_size
            note_routing(request.request_id, RoutingNote(replica, expected_tokens, time.monotonic()))

    def _track(self, pending_request: PendingRequest, replica: str, probes: PromptProbes) -> None:
        key = pending_request.metadata.internal_request_id
        self._in_flight.put(key, InFlight(replica, probes, pending_request.future, time.time()))
        self._last_chosen[replica] = time.time()

    def _in_flight_by_replica(self, reports: dict[str, ReplicaReport | None], now: float) -> Counter[str]:
        # A request cancelled while being routed, or after it was given a replica but before it was sent, never
        # completes: its entry goes here instead (at once, or once its grace is over).
        for key in [k for k, routed in self._in_flight.items() if routed.future.cancelled() or not routed.counts(now)]:
            routed = self._in_flight.pop(key)
            if not routed.future.cancelled():
                log.info("request %s was given replica %s but never sent: no longer counted there", key, routed.replica)
        self._forget_what_reports_disprove(reports, now)
        return Counter(routed.replica for routed in self._in_flight.values())

    def _forget_what_reports_disprove(self, reports: dict[str, ReplicaReport | None], now: float) -> None:
        """Requests sent that a replica's fresh report cannot still hold (see REPORT_SETTLE_S) stop counting."""
        settled: dict[str, list[tuple[float, str]]] = {}
        for key, routed in self._in_flight.items():
            report = reports.get(routed.replica)
            sent_at = routed.accepted_at or (routed.chosen_at if routed.future.done() else None)
            if (report is not None and sent_at is not None and report.is_fresh(now, self.settings.stale_after_s)
                    and sent_at < report.reported_at - REPORT_SETTLE_S):
                settled.setdefault(routed.replica, []).append((sent_at, key))
        for replica, entries in settled.items():
            gone = [key for _, key in sorted(entries)[:max(len(entries) - reports[replica].num_held, 0)]]
            for key in gone:
                self._in_flight.pop(key)
            if gone:
                log.info("replica %s reported holding %d requests; %d this router still counted there had ended "
                         "unreported: no longer counted", replica, reports[replica].num_held, len(gone))

    def _refresh_serve_counts(self, replicas: list[RunningReplica], reports: dict[str, ReplicaReport | None],
                              now: float) -> None:
        """Serve's cached count of a replica's ongoing requests is refreshed only by sending to it; a fresh report
        newer than this router's last send there is newer information (see REPORT_SETTLE_S)."""
        for replica in replicas:
            key = replica.replica_id.unique_id
            report = reports.get(key)
            if report is None or not report.is_fresh(now, self.settings.stale_after_s):
                continue
            if report.reported_at - REPORT_SETTLE_S <= self._last_chosen.get(key, 0.0):
                continue
            serve_count = self.replica_queue_len_cache.get(replica.replica_id)
            if serve_count is not None and serve_count > report.num_held:
                log.info("replica %s reported holding %d requests; Serve's count of %d predates it: corrected",
                         key, report.num_held, serve_count)
                self.on_new_queue_len_info(replica.replica_id, report.num_held)

    def _live_load(self, replica: RunningReplica, in_flight: Counter[str]) -> int | None:
        """Serve's count of the replica's ongoing requests (every router's, refreshed on each send), or this
        router's own count when that is lower: it includes requests chosen but not sent yet."""
        serve_count = self.replica_queue_len_cache.get(replica.replica_id)
        own = in_flight.get(replica.replica_id.unique_id, 0)
        if serve_count is None:
            return own or None
        return max(serve_count, own)


def _avoided_replicas(pending_request: PendingRequest | None) -> tuple[str, ...]:
    request = _engine_request(pending_request) if pending_request is not None else None
    return request.avoid_replicas if request is not None else ()


def _avoiding(order: list[str], avoided: tuple[str, ...]) -> list[str]:
    """Replicas that already failed this request go last: a retry lands elsewhere whenever it can."""
    if not avoided:
        return order
    return [r for r in order if r not in avoided] + [r for r in order if r in avoided]


def _engine_request(pending_request: PendingRequest) -> EngineRequest | None:
    return next((a for a in (*pending_request.args, *pending_request.kwargs.values())
                 if isinstance(a, EngineRequest)), None)


def request_router_config(args: AppArgs) -> RequestRouterConfig:
    """The engine deployment's router: PrefixAwareRouter, or Serve's default with `router.policy: power_of_two`."""
    settings = args.router_settings()
    if settings.policy == "power_of_two":
        return RequestRouterConfig(request_routing_stats_period_s=settings.stats_period_s)
    return RequestRouterConfig(request_router_class=PrefixAwareRouter, request_router_kwargs=settings.model_dump(),
                               request_routing_stats_period_s=settings.stats_period_s)
