"""What one request is (RequestSpec) and what happened to it (RequestRecord)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: the prompt with its exact token count, and when to send it if the load is scheduled."""

    index: int
    prompt: str
    input_tokens: int  # tokens of the prompt text alone (no chat template, no BOS), as AIPerf counts them
    max_tokens: int
    send_offset_s: float | None = None  # seconds after the run starts (trace replay); None: as the load mode decides
    hash_ids: tuple[int, ...] = ()
    trace_timestamp_ms: float | None = None


@dataclass(frozen=True)
class ErrorDetails:
    """Why a request failed, in AIPerf's shape: HTTP status (or 499 for a cancel, 0 before any response)."""

    code: int
    type: str
    message: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens


@dataclass
class RequestRecord:
    """Everything the client saw of one request. Times: wall-clock ns for when, perf-counter ns for how long."""

    request_id: str
    index: int
    phase: str  # "warmup" | "profiling"
    input_tokens: int
    max_tokens: int
    start_ns: int  # time.time_ns() when the request was sent
    start_perf_ns: int
    ack_perf_ns: int | None = None  # response headers received
    chunk_perf_ns: list[int] = field(default_factory=list)  # arrival of each chunk that carried content
    chunk_chars: list[int] = field(default_factory=list)  # characters of content in each of those chunks
    end_perf_ns: int | None = None  # last byte of the response
    output_text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    error: ErrorDetails | None = None
    cancelled: bool = False
    scheduled_offset_s: float | None = None  # when the schedule wanted it sent, relative to the run start
    streamed: bool = True

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def end_ns(self) -> int:
        """Wall-clock ns of the last byte (or of the failure)."""
        end = self.end_perf_ns if self.end_perf_ns is not None else self.start_perf_ns
        return self.start_ns + (end - self.start_perf_ns)
