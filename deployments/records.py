"""Records that cross the Ray hop between the ingress and an engine replica (pickled, so plain dataclasses)."""
from __future__ import annotations

from dataclasses import dataclass, field

from deployments.token_channel import ChannelAddress
from engine.outputs import EngineOutput, EngineStartup, EngineStats, SchedulerStats
from engine.sampling_params import SamplingParams
from engine.tenancy import DEFAULT_TENANCY, Tenancy


@dataclass
class EngineRequest:
    """A prompt, already tokenized, to be sampled ``n`` times on one replica (so the copies share its prefix cache);
    a completions batch adds its other prompts, each sampled ``n`` times too (choice i * n + j is prompt i's j-th).
    One Serve call per HTTP request: Serve's router keys a call by its HTTP request's id."""

    request_id: str
    prompt_token_ids: list[int]  # the first prompt: the one the router scores replicas by
    sampling: SamplingParams
    n: int = 1
    arrival_time: float = 0.0
    deadline: float | None = None  # time.time() past which nobody waits for the answer
    avoid_replicas: tuple[str, ...] = ()  # replicas that already failed this request: routed to last
    more_prompt_token_ids: list[list[int]] = field(default_factory=list)
    tenancy: Tenancy = DEFAULT_TENANCY  # tenant, weight, priority, cache salt (the router hashes with the salt)
    channel: ChannelAddress | None = None  # the ingress's token channel: chunks after the first go there
    channel_key: int = 0  # this request's key on it

    @property
    def prompts(self) -> list[list[int]]:
        return [self.prompt_token_ids, *self.more_prompt_token_ids]


@dataclass
class EngineTimeline:
    """One choice's life on its engine replica, in that replica's monotonic clock, as offsets from the moment
    `generate` was called there. The ingress joins it with its own clock by durations only."""

    replica_id: str
    events: list[tuple[float, int, int]]  # (offset_s, engine.request.EventKind, value), in order
    first_chunk_s: float  # the replica handed its first chunk of this choice on (to the token channel or Serve)
    end_s: float  # ... and its final one
    num_decode_steps: int
    num_preemptions: int
    num_cached_tokens: int
    num_dropped_events: int = 0


@dataclass
class GenerationChunk:
    """One choice's new tokens since its previous chunk: the engine's own output (without its timings, which the
    replica turns into `timeline`), numbered by choice."""

    index: int
    output: EngineOutput  # failure is always None: a failed choice ends the stream with a RequestRejected
    timeline: EngineTimeline | None = None  # on a choice's final chunk, when timelines are on


@dataclass
class RequestRejected:
    """The engine replica refused or failed the request; the message tells the caller what happened and what to
    change. `status` is the HTTP status it answers with: 400 for the request's own input, 408 for a deadline
    that passed in the queue, 500 for a failed engine step (never worth retrying as is), 503 for a full replica
    (with `retry_after_s`)."""

    message: str
    param: str | None = None
    code: str | None = None
    status: int = 400
    retry_after_s: float | None = None


@dataclass
class ReplicaStats(EngineStats):
    """One replica's engine gauges and counters and what the replica adds, for health checks, routing and
    autoscaling."""

    replica_id: str = ""
    num_used_kv_blocks: int = 0  # held by live requests; freed blocks kept for the prefix cache count as free
    num_active_streams: int = 0
    backlog_s: float | None = None  # seconds to drain what it holds (engine.backlog); None: no estimate yet
    # Filled in for the request router only (deployments/block_digest.py): the replica's time.time() when read,
    # and a Bloom filter over the block hashes its prefix cache holds.
    reported_at: float = 0.0
    cached_block_digest: bytes = b""


@dataclass
class ReplicaSteps:
    """An engine replica's recent engine steps, for the step trace (times are that replica's time.time())."""

    replica_id: str
    pid: int
    node_id: str
    now: float  # the replica's time.time() when it answered
    steps: list[SchedulerStats]


@dataclass
class ProfileResult:
    """What one engine replica's profiler did: started, or stopped and wrote its trace to `path`."""

    replica_id: str
    running: bool
    changed: bool  # False: it was already in that state
    path: str | None = None


@dataclass
class ColdStart:
    """Where an engine replica's start went, from its worker process's start to ready (wall clock)."""

    replica_id: str
    process_started_at: float  # time.time() when the worker process started
    ready_at: float
    init_s: float  # the replica's own construction: the engine and what surrounds it
    engine: EngineStartup  # within that: weights, model, kernels (and whether they were compiled)
