"""Replay a workload against an autoscaling policy on simulated engine replicas, as Ray Serve would run them.

What is modelled, and from where in Serve (Ray 2.60):
- metrics: each running replica records its engine signals every min(look_back * 0.2, metrics_interval_s) and
  pushes them every metrics_interval_s (`replica.py`, `start_metrics_pusher`); the controller averages each over
  the look-back window (`_get_aggregated_custom_metrics`); ongoing requests are recorded and pushed the same way.
- decisions: every control-loop tick the policy sees DeploymentSignals; its answer goes through Serve's scaling
  factors, delays and bounds (autoscaling/serve_rules.py), as `_apply_autoscaling_config` wraps any policy.
- replicas: a new one costs from the moment it is asked for and serves after `startup_s`; one scaled away is
  picked as Serve picks (not yet running first, then the newest), stops taking requests and drains for up to
  `graceful_shutdown_timeout_s`; what it still holds then fails.
- routing: Serve's default power-of-two-choices on ongoing requests; `max_ongoing_requests` per replica, beyond
  which requests queue in the handle.
Everything random draws from one seeded generator and ties break in event order, so a seed fixes the result.
"""
from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from autoscaling.capacity import SLO
from autoscaling.policy import QueueKVConfig, queue_kv_decision
from autoscaling.replica import SimReplica, SimRequest
from autoscaling.replica_load import ReplicaLoad
from autoscaling.serve_rules import (ServeAutoscalingConfig, apply_serve, cold_start_replicas,
                                     ongoing_requests_decision)
from autoscaling.signals import DeploymentSignals, ReplicaSignals
from autoscaling.slo_policy import SLOConfig, slo_decision
from autoscaling.step_model import ReplicaProfile
from autoscaling.workload import RequestSpec

RECORD_INTERVAL_FACTOR = 0.2  # RAY_SERVE_AUTOSCALING_METRIC_RECORD_INTERVAL_FACTOR


class Policy(Protocol):
    name: str

    def __call__(self, signals: DeploymentSignals, state: dict[str, Any]) -> tuple[float, dict[str, Any]]: ...


@dataclass(frozen=True)
class OngoingRequestsPolicy:
    """Serve's default policy: `target_ongoing_requests` per replica."""

    target_ongoing_requests: float = 2.0
    name: str = "ongoing_requests"

    def __call__(self, signals: DeploymentSignals, state: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        return ongoing_requests_decision(signals, self.target_ongoing_requests), state


@dataclass(frozen=True)
class QueueKVSimPolicy:
    """autoscaling.policy's queue + KV policy, the same function Serve calls through QueueKVPolicy."""

    config: QueueKVConfig = field(default_factory=QueueKVConfig)
    name: str = "queue_kv"

    def __call__(self, signals: DeploymentSignals, state: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        decision = queue_kv_decision(signals, self.config, state)
        return decision.num_replicas, decision.state


@dataclass(frozen=True)
class SLOSimPolicy:
    """autoscaling.slo_policy's SLO policy, the same function Serve calls through SLOPolicy."""

    config: SLOConfig = field(default_factory=SLOConfig)
    name: str = "slo"

    @property
    def slo(self) -> SLO:
        """What replicas report their capacity against (they solve it only for a policy that has one)."""
        return self.config.slo

    def __call__(self, signals: DeploymentSignals, state: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        decision = slo_decision(signals, self.config, state)
        return decision.num_replicas, decision.state


@dataclass(frozen=True)
class ClusterConfig:
    serve: ServeAutoscalingConfig
    initial_replicas: int = 1
    startup_s: float = 15.0  # asked for -> serving: actor start, model load, first step
    graceful_shutdown_timeout_s: float = 60.0
    control_interval_s: float = 0.5  # Serve's loop runs every 0.1 s; decisions only move at the delays' pace
    max_ongoing_requests: int = 256
    prefix_cache: bool = True
    # A step's time as a multiple of the profile's while another replica steps at the same time: replicas that
    # share a node's cores with the serving processes (the proxy, the ingress, a load client) slow each other
    # down, which a profile measured on one engine alone does not see. 1.0: each replica has its own hardware.
    busy_slowdown: float = 1.0
    # The engines' `ttft_objective_s`: a request waiting longer than half of it with no first token goes behind
    # those that can still meet it (engine.tenancy.WaitingQueue). None: arrival order.
    ttft_objective_s: float | None = None
    seed: int = 0
    max_sim_s: float = 24 * 3600.0


@dataclass(frozen=True)
class TimelinePoint:
    t: float
    target: int
    running: int
    starting: int
    draining: int
    ongoing: int
    waiting: int
    kv_usage: float  # mean over running replicas


@dataclass
class SimResult:
    policy: str
    requests: list[SimRequest]
    timeline: list[TimelinePoint]
    replica_seconds: float
    duration_s: float
    max_replicas_seen: int


@dataclass
class _Metrics:
    """A replica's (or the handles') recorded samples and how far the controller has seen them."""

    samples: list[tuple[float, Any]] = field(default_factory=list)
    pushed_until: float = -1.0
    next_push: float = 0.0

    def visible(self, start: float) -> list[Any]:
        """The samples the controller has received that fall in the look-back window."""
        return [value for t, value in self.samples if start <= t <= self.pushed_until]

    def prune(self, before: float) -> None:
        drop = 0
        while drop < len(self.samples) and self.samples[drop][0] < before:
            drop += 1
        del self.samples[:drop]


class Simulation:
    def __init__(self, requests: list[RequestSpec], profile: ReplicaProfile, policy: Policy,
                 cluster: ClusterConfig) -> None:
        self.specs = sorted(requests, key=lambda r: r.arrival_s)
        self.profile = profile
        self.policy = policy
        self.cluster = cluster
        self.serve = cluster.serve
        self.rng = random.Random(cluster.seed)
        self.events: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self.replicas: list[SimReplica] = []
        self._replica_ids = itertools.count()
        self.handle_queue: deque[SimRequest] = deque()
        self.requests = [SimRequest(i, spec) for i, spec in enumerate(self.specs)]
        self.target = cluster.initial_replicas
        self.user_state: dict[str, Any] = {}
        self.serve_state: dict[str, Any] = {}
        self.metrics: dict[int, _Metrics] = {}
        self.handle_metrics = _Metrics()
        self.timeline: list[TimelinePoint] = []
        self.replica_seconds = 0.0
        self._cost_at = 0.0
        self._done = 0
        self.record_interval_s = min(self.serve.look_back_period_s * RECORD_INTERVAL_FACTOR,
                                     self.serve.metrics_interval_s)

    def run(self) -> SimResult:
        for request in self.requests:
            self._push(request.spec.arrival_s, "arrival", request)
        for _ in range(self.target):
            self._start_replica(0.0, ready=True)  # the deployment is up before the workload starts
        self._push(0.0, "tick", None)
        self._push(0.0, "record", None)
        now = 0.0
        while self.events and self._done < len(self.requests):
            now, _, kind, payload = heapq.heappop(self.events)
            if now > self.cluster.max_sim_s:
                break
            self._account(now)
            getattr(self, f"_on_{kind}")(now, payload)
        self._account(now)
        for request in self.requests:
            if not request.finished:
                request.failed = "unfinished"
        return SimResult(self.policy.name, self.requests, self.timeline, self.replica_seconds, now,
                         max((p.running + p.starting + p.draining for p in self.timeline), default=0))

    def _push(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.events, (t, next(self._seq), kind, payload))

    def _account(self, now: float) -> None:
        alive = sum(1 for r in self.replicas if r.state != "stopped")
        self.replica_seconds += alive * (now - self._cost_at)
        self._cost_at = now

    def _live(self, *states: str) -> list[SimReplica]:
        return [r for r in self.replicas if r.state in states]

    # events

    def _on_arrival(self, now: float, request: SimRequest) -> None:
        self.handle_queue.append(request)
        if not self._live("running"):
            # Serve's handle pushes its queue to the controller at once when there is no replica to take it.
            self.handle_metrics.samples.append((now, self._ongoing()))
            self.handle_metrics.pushed_until = now
        self._route(now)

    def _on_ready(self, now: float, replica: SimReplica) -> None:
        if replica.state == "starting":
            replica.state = "running"
            self.metrics[replica.replica_id] = _Metrics(next_push=now + self.serve.metrics_interval_s)
            self._route(now)

    def _on_step_end(self, now: float, replica: SimReplica) -> None:
        finished = replica.finish_step(now)
        self._done += len(finished)
        if finished:
            self._route(now)
        self._maybe_step(replica, now)
        if replica.state == "draining" and not replica.num_ongoing and replica.step is None:
            replica.state, replica.stopped_at = "stopped", now

    def _on_drain_deadline(self, now: float, replica: SimReplica) -> None:
        if replica.state == "draining":
            self._done += len(replica.kill(now))

    def _on_record(self, now: float, _: Any) -> None:
        running = self._live("running")
        for replica in running:
            metrics = self.metrics[replica.replica_id]
            metrics.samples.append((now, replica.signals(now)))
            if now >= metrics.next_push:
                metrics.pushed_until, metrics.next_push = now, now + self.serve.metrics_interval_s
        self.handle_metrics.samples.append((now, self._ongoing()))
        if now >= self.handle_metrics.next_push:
            self.handle_metrics.pushed_until = now
            self.handle_metrics.next_push = now + self.serve.metrics_interval_s
        self._push(now + self.record_interval_s, "record", None)

    def _on_tick(self, now: float, _: Any) -> None:
        signals = self._signals(now)
        if cold_start_replicas(signals, self.serve) is not None:
            desired = float(signals.target_replicas)  # Serve's fast path answers without asking the policy
        else:
            desired, self.user_state = self.policy(signals, self.user_state)
        target, self.serve_state = apply_serve(desired, signals, self.serve, self.serve_state)
        if target != self.target:
            self._scale(now, target)
        self._record_timeline(now)
        self._push(now + self.cluster.control_interval_s, "tick", None)

    # control

    def _signals(self, now: float) -> DeploymentSignals:
        start = now - self.serve.look_back_period_s
        running = self._live("running")
        replicas: list[ReplicaSignals | None] = []
        for replica in running:
            metrics = self.metrics[replica.replica_id]
            metrics.prune(start)
            seen = metrics.visible(start)
            replicas.append(_mean_signals(seen) if seen else None)
        self.handle_metrics.prune(start)
        ongoing = self.handle_metrics.visible(start)
        return DeploymentSignals(current_replicas=len(running), target_replicas=self.target,
                                 min_replicas=self.serve.min_replicas, max_replicas=self.serve.max_replicas,
                                 total_ongoing=sum(ongoing) / len(ongoing) if ongoing else 0.0,
                                 replicas=tuple(replicas), now=now, upscale_delay_s=self.serve.upscale_delay_s,
                                 look_back_period_s=self.serve.look_back_period_s,
                                 metrics_interval_s=self.serve.metrics_interval_s)

    def _ongoing(self) -> int:
        return len(self.handle_queue) + sum(r.num_ongoing for r in self.replicas if r.state != "stopped")

    def _scale(self, now: float, target: int) -> None:
        self.target = target
        live = self._live("starting", "running")
        for _ in range(target - len(live)):
            self._start_replica(now)
        if target < len(live):
            # Serve stops replicas that are not running yet first, then the newest.
            order = sorted(live, key=lambda r: (r.state == "running", -r.started_at, -r.replica_id))
            for replica in order[: len(live) - target]:
                self._stop_replica(replica, now)

    def _start_replica(self, now: float, ready: bool = False) -> None:
        replica = SimReplica(next(self._replica_ids), self.profile.engine, self.profile.step_model, now,
                             now if ready else now + self.cluster.startup_s, self.cluster.prefix_cache,
                             ReplicaLoad(self.profile, slo) if (slo := getattr(self.policy, "slo", None)) else None,
                             self.cluster.ttft_objective_s)
        self.replicas.append(replica)
        if ready:
            self._on_ready(now, replica)
        else:
            self._push(replica.ready_at, "ready", replica)

    def _stop_replica(self, replica: SimReplica, now: float) -> None:
        if replica.state == "starting":
            replica.state, replica.stopped_at = "stopped", now
            return
        replica.state = "draining"
        self.metrics.pop(replica.replica_id, None)
        if not replica.num_ongoing and replica.step is None:
            replica.state, replica.stopped_at = "stopped", now
        else:
            self._push(now + self.cluster.graceful_shutdown_timeout_s, "drain_deadline", replica)

    def _route(self, now: float) -> None:
        """Power of two choices among running replicas with room; the rest waits in the handle."""
        while self.handle_queue:
            open_replicas = [r for r in self._live("running")
                             if r.num_ongoing < self.cluster.max_ongoing_requests]
            if not open_replicas:
                return
            request = self.handle_queue.popleft()
            pair = self.rng.sample(open_replicas, 2) if len(open_replicas) > 1 else open_replicas
            replica = min(pair, key=lambda r: r.num_ongoing)
            if not replica.fits(request):
                request.failed = "too_long"
                self._done += 1
                continue
            replica.add(request, now)
            self._maybe_step(replica, now)

    def _maybe_step(self, replica: SimReplica, now: float) -> None:
        if replica.step is None and replica.state in ("running", "draining"):
            slowdown = 1.0
            if self.cluster.busy_slowdown != 1.0 and any(r.step is not None for r in self._live("running", "draining")):
                slowdown = self.cluster.busy_slowdown  # another replica steps now (this one has no step yet)
            step = replica.start_step(now, slowdown)
            if step is not None:
                self._push(now + step.seconds, "step_end", replica)

    def _record_timeline(self, now: float) -> None:
        running = self._live("running")
        self.timeline.append(TimelinePoint(
            t=now, target=self.target, running=len(running), starting=len(self._live("starting")),
            draining=len(self._live("draining")),
            ongoing=len(self.handle_queue) + sum(r.num_ongoing for r in self._live("running", "draining")),
            waiting=len(self.handle_queue) + sum(len(r.waiting) for r in running),
            kv_usage=sum(r.kv_usage for r in running) / len(running) if running else 0.0))


def _mean_signals(samples: list[ReplicaSignals]) -> ReplicaSignals:
    """Serve averages each metric over the look-back window on its own."""
    n = len(samples)
    capacities = [s.capacity_tokens_per_s for s in samples if s.capacity_tokens_per_s is not None]
    alone = [s.capacity_alone_tokens_per_s for s in samples if s.capacity_alone_tokens_per_s is not None]
    return ReplicaSignals(kv_usage=sum(s.kv_usage for s in samples) / n,
                          num_waiting=sum(s.num_waiting for s in samples) / n,
                          num_running=sum(s.num_running for s in samples) / n,
                          preemptions_per_s=sum(s.preemptions_per_s for s in samples) / n,
                          capacity_tokens_per_s=sum(capacities) / len(capacities) if capacities else None,
                          capacity_alone_tokens_per_s=sum(alone) / len(alone) if alone else None,
                          demand_tokens_per_s=sum(s.demand_tokens_per_s for s in samples) / n,
                          arrivals_per_s=sum(s.arrivals_per_s for s in samples) / n)


def simulate(requests: list[RequestSpec], profile: ReplicaProfile, policy: Policy,
             cluster: ClusterConfig) -> SimResult:
    return Simulation(requests, profile, policy, cluster).run()
