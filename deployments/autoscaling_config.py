"""How the engine deployment scales: the `autoscaling` section of AppArgs, and the Serve options it becomes.

The ingress keeps Serve's request-based autoscaler (`ingress_*` fields); this section is the engine replicas'.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from autoscaling.policy import QueueKVConfig
from autoscaling.replica_load import ReplicaLoad
from autoscaling.slo_policy import SLOConfig
from autoscaling.step_model import ReplicaProfile

QUEUE_KV_POLICY = "autoscaling.policy:QueueKVPolicy"
SLO_POLICY = "autoscaling.slo_policy:SLOPolicy"


class AutoscalingArgs(BaseModel):
    """Off: `num_engine_replicas` engine replicas, always. On: Serve moves the count between min and max replicas
    as the policy asks, after its delays; `num_engine_replicas` is then the count it starts with."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    # slo: autoscaling.slo_policy (capacity at the SLO against a forecast of the load); queue_kv:
    # autoscaling.policy (engine queues and KV usage); ongoing_requests: Serve's default policy.
    policy: Literal["slo", "queue_kv", "ongoing_requests"] = "queue_kv"
    # 0: no replica while idle; requests then wait at the ingress while the first one starts (policy slo or
    # ongoing_requests: queue_kv never asks for fewer than one).
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(2, ge=1)
    # How long the policy must keep asking for more (fewer) replicas before Serve adds (removes) them.
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(120.0, ge=0)
    # ... and for the last one, 1 -> 0 (None: downscale_delay_s).
    downscale_to_zero_delay_s: float | None = Field(None, ge=0)
    # Each replica's stats are averaged over this window; they reach the controller every metrics_interval_s.
    look_back_period_s: float = Field(10.0, gt=0)
    metrics_interval_s: float = Field(1.0, gt=0)
    # Serve's default policy only: ongoing requests per replica it aims for.
    target_ongoing_requests: float = Field(32.0, gt=0)
    queue_kv: QueueKVConfig = Field(default_factory=QueueKVConfig)
    slo: SLOConfig = Field(default_factory=SLOConfig)

    @model_validator(mode="after")
    def _consistent(self) -> "AutoscalingArgs":
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"autoscaling.max_replicas ({self.max_replicas}) is below autoscaling.min_replicas "
                             f"({self.min_replicas})")
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(f"autoscaling.look_back_period_s ({self.look_back_period_s}) must exceed "
                             f"autoscaling.metrics_interval_s ({self.metrics_interval_s})")
        if self.min_replicas == 0 and self.policy == "queue_kv":
            raise ValueError("autoscaling.min_replicas 0 needs autoscaling.policy slo or ongoing_requests: "
                             "queue_kv never asks for fewer than one replica")
        return self


@functools.lru_cache(maxsize=8)
def profile_budget_beside_decodes(profile: str) -> int | None:
    """The token budget of a step beside decodes that a replica profile (autoscaling/profiles) was recorded with."""
    return ReplicaProfile.load(profile).engine.max_tokens_with_decodes


def replica_load(args: AutoscalingArgs) -> ReplicaLoad | None:
    """What an engine replica reports to the SLO policy; None when that policy is not the one scaling it."""
    if not (args.enabled and args.policy == "slo"):
        return None
    return ReplicaLoad(ReplicaProfile.load(args.slo.profile), args.slo.slo)


def engine_autoscaling_config(args: AutoscalingArgs, num_engine_replicas: int) -> dict[str, Any] | None:
    """Serve's `autoscaling_config` for the engine deployment, or None when the count is fixed."""
    if not args.enabled:
        return None
    config: dict[str, Any] = {
        "min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
        "initial_replicas": min(max(num_engine_replicas, args.min_replicas), args.max_replicas),
        "upscale_delay_s": args.upscale_delay_s, "downscale_delay_s": args.downscale_delay_s,
        "look_back_period_s": args.look_back_period_s, "metrics_interval_s": args.metrics_interval_s,
    }
    if args.downscale_to_zero_delay_s is not None:
        config["downscale_to_zero_delay_s"] = args.downscale_to_zero_delay_s
    if args.policy == "queue_kv":
        config["policy"] = {"policy_function": QUEUE_KV_POLICY, "policy_kwargs": dataclasses.asdict(args.queue_kv)}
    elif args.policy == "slo":
        config["policy"] = {"policy_function": SLO_POLICY, "policy_kwargs": dataclasses.asdict(args.slo)}
    else:
        config["target_ongoing_requests"] = args.target_ongoing_requests
    return config
