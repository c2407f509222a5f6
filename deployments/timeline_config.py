"""The `timeline` section of AppArgs: request timelines and the engine step trace, and what they keep."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TimelineArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="engine request events, joined timelines, stage histograms, step trace")
    store_size: int = Field(1024, ge=1, description="recent timelines each ingress replica keeps for GET by id")
    step_ring: int = Field(4096, ge=16, description="recent engine steps each engine replica keeps for the trace")
