"""Per-request sampling parameters, validated before a request touches engine state."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


class InvalidRequestError(ValueError):
    """A request the engine will not accept; the message says what the caller must change."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives; 0 returns only the sampled token's logprob

    def validate(self) -> None:
        def bad(msg: str, param: str) -> None:
            raise InvalidRequestError(msg, param)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.temperature < 0:
            bad(f"temperature must be non-negative, got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            bad(f"top_k must be -1 (disabled), 0 (disabled) or positive, got {self.top_k}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.min_tokens < 0:
            bad(f"min_tokens must be non-negative, got {self.min_tokens}", "min_tokens")
        if self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})", "min_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}", "logprobs")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:  # torch generators take 64 bits
            bad(f"seed must fit in a signed 64-bit integer, got {self.seed}", "seed")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers", "stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
