"""A request's state inside the engine: its tokens, progress, blocks and timestamps."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.failures import RequestFailure
from engine.hashing import BlockHash, hash_block_chain, root_hash
from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarState
from engine.tenancy import DEFAULT_TENANCY, Tenancy


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything above this line is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # the request's `failure` says why

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}.get(self)


class EventKind(enum.IntEnum):
    """What happened to a request inside the engine; a decode step is counted, never recorded as an event."""

    ENQUEUED = 0
    SCHEDULED = 1  # first scheduled
    PREFILL_CHUNK = 2  # value: prompt (or recomputed) tokens computed in that step
    FIRST_TOKEN = 3
    PREEMPTED = 4
    RESUMED = 5  # scheduled again after a preemption
    FINISHED = 6  # value: the RequestStatus it finished with


class RequestEvent(NamedTuple):
    time: float  # time.monotonic() of the engine's process: durations only, never compared across processes
    kind: EventKind
    value: int = 0


# A request preempted over and over must not grow without bound: past this, only FINISHED is kept (and counted).
MAX_REQUEST_EVENTS = 64


@dataclass
class RequestTimings:
    """Wall-clock timestamps (time.time()) and a monotonic twin, the event list, for durations within this process."""

    arrival: float
    queued: float | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    preemptions: list[float] = field(default_factory=list)
    events: list[RequestEvent] | None = None  # None: events are off for this engine
    num_decode_steps: int = 0
    num_dropped_events: int = 0

    def record(self, kind: EventKind, value: int = 0) -> None:
        events = self.events
        if events is None:
            return
        if len(events) < MAX_REQUEST_EVENTS - 1 or kind == EventKind.FINISHED:
            events.append(RequestEvent(time.monotonic(), kind, value))
        else:
            self.num_dropped_events += 1


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 block_size: int, eos_token_ids: tuple[int, ...] = (), arrival_time: float | None = None,
                 extra_keys: tuple | None = None, record_events: bool = True, deadline: float | None = None,
                 tenancy: Tenancy = DEFAULT_TENANCY) -> None:
        self.request_id = request_id
        self.tenancy = tenancy
        self.running_order = (tenancy.priority, 0)  # set by the scheduler at each admission
        self.deadline = deadline  # time.time() past which nobody waits for it any more
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[TokenLogprobs] = []
        self.all_token_ids = list(prompt_token_ids)
        self.status = RequestStatus.WAITING
        # The one number of progress: how many of all_token_ids have their KV in the cache.
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.num_preemptions = 0
        # Waited past the engine's TTFT objective with no first token: queued behind those that can still meet it.
        self.late = False
        self.block_ids: list[int] = []
        self.block_size = block_size
        self.extra_keys = extra_keys
        self.root_hash = root_hash(tenancy.cache_salt)
        self.block_hashes: list[BlockHash] = hash_block_chain(self.all_token_ids, block_size, extra_keys,
                                                              self.root_hash)
        self.stop_ids = set(sampling_params.stop_token_ids)
        self.eos_token_ids = set(eos_token_ids)
        self.timings = RequestTimings(arrival=arrival_time if arrival_time is not None else time.time(),
                                      events=[] if record_events else None)
        self.failure: RequestFailure | None = None  # set when it finishes with FINISHED_ERROR
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling_params.seed)
        self.grammar: GrammarState | None = None  # set by the engine for structured output
        # Logprobs of prompt tokens 1.. (when asked for), filled chunk by chunk during prefill.
        self.prompt_logprobs: list[TokenLogprobs] = []

    @property
    def ready(self) -> bool:
        """False while its grammar compiles: the scheduler schedules others meanwhile."""
        return self.grammar is None or self.grammar.ready

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if len(self.all_token_ids) % self.block_size == 0:
            parent = self.block_hashes[-1] if self.block_hashes else self.root_hash
            self.block_hashes.extend(hash_block_chain(self.all_token_ids, self.block_size, self.extra_keys,
                                                      parent, start=len(self.block_hashes) * self.block_size))

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The status this request finishes with after its newest token, or None if it goes on."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if last in self.stop_ids or (not params.ignore_eos and last in self.eos_token_ids):
                return RequestStatus.FINISHED_STOPPED
        if self.grammar is not None and self.grammar.terminated:  # the grammar took its end: nothing may follow
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
