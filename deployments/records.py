"""Records that cross the Ray hop between the ingress and an engine replica (pickled, so plain dataclasses)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import TokenLogprobs
from engine.sampling_params import SamplingParams


@dataclass
class EngineRequest:
    """One prompt, already tokenized, to be sampled ``n`` times on one replica (so the copies share its prefix cache)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    n: int = 1
    arrival_time: float = 0.0


@dataclass
class GenerationChunk:
    """New tokens of one choice since its previous chunk."""

    index: int
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class RequestRejected:
    """The engine refused the request; the message tells the caller what to change."""

    message: str
    param: str | None = None


@dataclass
class ModelInfo:
    """What the ingress must know about the engine to validate and frame requests."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_kv_blocks: int
    block_size: int


@dataclass
class ReplicaStats:
    """One replica's engine gauges and counters, for health checks, routing and autoscaling."""

    replica_id: str
    num_running: int
    num_waiting: int
    kv_usage: float
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_used_kv_blocks: int  # held by live requests; freed blocks kept for the prefix cache count as free
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_finished_requests: int
    num_active_streams: int
    # Filled in for the request router only (deployments/block_digest.py): the replica's time.time() when read,
    # and a Bloom filter over the block hashes its prefix cache holds.
    block_size: int = 0
    reported_at: float = 0.0
    cached_block_digest: bytes = b""
