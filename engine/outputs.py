"""Records the engine hands out: per-request outputs, per-step scheduler stats, what the engine is."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.failures import RequestFailure
from engine.request import RequestTimings, TokenLogprobs
from engine.request_limits import RequestLimits


@dataclass
class EngineOutput:
    """What one step produced for one request; ``new_token_ids`` may be empty (mid-prefill, or aborted)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    timings: RequestTimings | None = None  # set on the final output
    failure: RequestFailure | None = None  # why it finished with "error"
    # Logprobs of prompt tokens 1.. when the request asked for them; on its first output only.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def merge(self, later: "EngineOutput") -> "EngineOutput":
        """Coalesce two outputs of one request (streaming in fewer, larger messages)."""
        self.new_token_ids = self.new_token_ids + later.new_token_ids
        self.logprobs = self.logprobs + later.logprobs
        self.prompt_logprobs = self.prompt_logprobs + later.prompt_logprobs
        for name in ("finished", "finish_reason", "num_output_tokens", "num_cached_tokens", "num_preemptions",
                     "timings", "failure"):
            setattr(self, name, getattr(later, name))
        return self


@dataclass
class SchedulerStats:
    """One engine step: the batch it ran and the state it left behind."""

    step: int
    time: float  # wall clock at step start
    duration_s: float
    num_running: int
    num_waiting: int
    kv_usage: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_prefill_requests: int
    num_decode_requests: int
    num_preempted: int
    prefix_cache_queries: int  # tokens looked up this step
    prefix_cache_hits: int
    num_finished: int
    num_context_tokens: int = 0  # tokens of KV the decodes attended to, summed (the step model's context term)
    prefill_attention: float = 0.0  # prefill chunks' (query, key) pairs, in millions
    # Where the step's time went (STEP_PHASES); what is left of duration_s is turning samples into outputs.
    schedule_s: float = 0.0
    prepare_s: float = 0.0  # the batch's input tensors
    forward_s: float = 0.0  # the model, up to the hidden states
    sample_s: float = 0.0  # logits of the rows that sample, and sampling
    # CPU: torch threads the step ran on (more than num_threads where it borrowed idle CPUs: prefill_threads,
    # decode_threads); 0 where not counted (a GPU).
    num_threads: int = 0


# The timed phases of a step, each a `<phase>_s` field of SchedulerStats.
STEP_PHASES = ("schedule", "prepare", "forward", "sample")


@dataclass
class EngineStats:
    """Cumulative counters and the current gauges, for metrics and health; all zero before the engine reports."""

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_late: int = 0  # of num_waiting, those past half the TTFT objective (engine.ttft_objective_s)
    kv_usage: float = 0.0
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    block_size: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_finished_requests: int = 0


@dataclass(frozen=True)
class EngineStartup:
    """Where an engine's construction went: reading the weights, building the model (prepacking included), and
    within that the native kernels (compiled when `kernels_built`, a build-cache miss)."""

    weights_s: float  # 0 when the caller handed the weights in
    model_s: float
    kernels_s: float
    kernels_built: bool
    total_s: float


@dataclass
class ModelInfo:
    """What the layers above must know about an engine to validate and frame requests; fixed once it started."""

    limits: RequestLimits
    eos_token_ids: tuple[int, ...]
    attention_backend: str = ""  # the backend the engine chose (auto resolved): torch, cpu, triton, flash-attn
    device: str = ""
    cuda_graphs: bool = False  # decode steps replay CUDA graphs
