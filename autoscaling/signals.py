"""What a replica-count policy sees at one decision: per-replica engine signals and Serve's request count.

The same records come from Ray Serve's `AutoscalingContext` (autoscaling/serve_policy.py) and from the simulator,
so a policy is a pure function of them and runs unchanged in both.
"""
from __future__ import annotations

from dataclasses import dataclass

# Keys of `EngineReplica.record_autoscaling_stats()`, as Serve aggregates them into `ctx.aggregated_metrics`.
KV_USAGE = "kv_usage"
NUM_WAITING = "num_waiting"
NUM_RUNNING = "num_running"
PREEMPTIONS_PER_S = "preemptions_per_s"
NUM_KV_BLOCKS = "num_kv_blocks"
METRIC_KEYS = (KV_USAGE, NUM_WAITING, NUM_RUNNING, PREEMPTIONS_PER_S, NUM_KV_BLOCKS)


@dataclass(frozen=True)
class ReplicaSignals:
    """One engine replica's load, averaged over Serve's look-back window."""

    kv_usage: float  # fraction of KV blocks held by requests (0..1)
    num_waiting: float  # requests queued in the engine, not yet scheduled
    num_running: float  # requests in the engine's running batch
    preemptions_per_s: float = 0.0  # requests evicted for lack of KV blocks


@dataclass(frozen=True)
class DeploymentSignals:
    """Everything one decision reads. `replicas` has one entry per running replica; None: it has not reported."""

    current_replicas: int  # running replicas
    target_replicas: int  # the count Serve is moving to (above `current_replicas` while replicas start)
    min_replicas: int
    max_replicas: int
    total_ongoing: float  # Serve's ongoing requests of the deployment: at replicas plus queued in handles
    replicas: tuple[ReplicaSignals | None, ...]
    now: float  # seconds, any clock the caller keeps consistent

    @property
    def reported(self) -> list[ReplicaSignals]:
        return [r for r in self.replicas if r is not None]

    @property
    def all_reported(self) -> bool:
        return bool(self.replicas) and all(r is not None for r in self.replicas)


def replica_signals(metrics: dict[str, float]) -> ReplicaSignals | None:
    """A replica's signals from its metric values; None when it has not reported the ones a policy needs."""
    if KV_USAGE not in metrics or NUM_WAITING not in metrics:
        return None
    return ReplicaSignals(kv_usage=float(metrics[KV_USAGE]), num_waiting=float(metrics[NUM_WAITING]),
                          num_running=float(metrics.get(NUM_RUNNING, 0.0)),
                          preemptions_per_s=float(metrics.get(PREEMPTIONS_PER_S, 0.0)))
