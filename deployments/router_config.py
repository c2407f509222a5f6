"""How engine requests are routed across replicas: the `router` section of AppArgs, and the router's own settings."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class RouterArgs(BaseModel):
    """`policy: prefix_aware` is deployments.router.PrefixAwareRouter; `power_of_two` is Ray Serve's default router."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["prefix_aware", "power_of_two"] = "prefix_aware"
    stats_period_s: float = Field(1.0, gt=0, description="how often each replica reports its routing stats")
    # Score = prefix_weight * cached share of the prompt + queue_weight * (1 - load / (max load + 1))
    #       + kv_weight * (1 - KV usage); llm-d's default scorer weights are 3 / 2 / 2.
    prefix_weight: float = Field(3.0, ge=0)
    queue_weight: float = Field(2.0, ge=0)
    kv_weight: float = Field(2.0, ge=0)
    # The load guard, as SGLang's router: when max load - min load > abs and max load > rel * min load,
    # the least-loaded replica wins whatever it caches.
    balance_abs_threshold: float = Field(8.0, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=1.0)
    routed_memory_s: float = Field(5.0, ge=0, description="how long a routed prompt's blocks count as on its replica")
    routed_memory_max_blocks: int = Field(65536, ge=0, description="routed block hashes remembered per replica")
    stale_after_s: float = Field(5.0, gt=0, description="a replica report older than this is ignored")
    digest_bits_per_block: int = Field(10, ge=1, le=64, description="Bloom filter bits per KV block of the pool")
    digest_max_bytes: int = Field(1 << 20, ge=8, description="upper bound of one replica's cache digest")


class RouterSettings(RouterArgs):
    """What PrefixAwareRouter.initialize_state receives (Serve passes it as JSON kwargs)."""

    block_size: int = Field(16, ge=1, description="the engine's KV block size, to hash prompts as the engine does")
