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
# ... and of the capacity model and offered load the SLO policy reads (autoscaling/replica_load.py).
CAPACITY_TOKENS_PER_S = "capacity_tokens_per_s"
CAPACITY_ALONE_TOKENS_PER_S = "capacity_alone_tokens_per_s"
DEMAND_TOKENS_PER_S = "demand_tokens_per_s"
ARRIVALS_PER_S = "arrivals_per_s"
STEP_CORRECTION = "step_correction"
METRIC_KEYS = (KV_USAGE, NUM_WAITING, NUM_RUNNING, PREEMPTIONS_PER_S, NUM_KV_BLOCKS, CAPACITY_TOKENS_PER_S,
               CAPACITY_ALONE_TOKENS_PER_S, DEMAND_TOKENS_PER_S, ARRIVALS_PER_S, STEP_CORRECTION)


@dataclass(frozen=True)
class ReplicaSignals:
    """One engine replica's load, averaged over Serve's look-back window."""

    kv_usage: float  # fraction of KV blocks held by requests (0..1)
    num_waiting: float  # requests queued in the engine, not yet scheduled
    num_running: float  # requests in the engine's running batch
    preemptions_per_s: float = 0.0  # requests evicted for lack of KV blocks
    capacity_tokens_per_s: float | None = None  # what it sustains at the SLO beside others; None: not reported
    capacity_alone_tokens_per_s: float | None = None  # ... as the only replica
    demand_tokens_per_s: float = 0.0  # tokens of work arriving per second
    arrivals_per_s: float = 0.0


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
    # Serve's own delays: how late a change the policy asks for takes effect, and how old the metrics are.
    upscale_delay_s: float = 0.0
    look_back_period_s: float = 0.0
    metrics_interval_s: float = 0.0

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
    capacity, alone = metrics.get(CAPACITY_TOKENS_PER_S), metrics.get(CAPACITY_ALONE_TOKENS_PER_S)
    return ReplicaSignals(kv_usage=float(metrics[KV_USAGE]), num_waiting=float(metrics[NUM_WAITING]),
                          num_running=float(metrics.get(NUM_RUNNING, 0.0)),
                          preemptions_per_s=float(metrics.get(PREEMPTIONS_PER_S, 0.0)),
                          capacity_tokens_per_s=None if capacity is None else float(capacity),
                          capacity_alone_tokens_per_s=None if alone is None else float(alone),
                          demand_tokens_per_s=float(metrics.get(DEMAND_TOKENS_PER_S, 0.0)),
                          arrivals_per_s=float(metrics.get(ARRIVALS_PER_S, 0.0)))
