"""Per-request sampling parameters, validated before a request touches engine state."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries, as OpenAI bounds it
LOGIT_BIAS_LIMIT = 100.0  # each bias is clamped to [-100, 100]
MAX_GRAMMAR_BYTES = 64 * 1024  # a schema, regex or grammar; larger ones cost seconds to compile
MAX_CHOICES = 256


class InvalidRequestError(ValueError):
    """A request the engine will not accept; the message says what the caller must change."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match, as vLLM names it: exactly one of a JSON schema (text), any JSON object, a
    regular expression, a list of choices, or a grammar (Lark, or GBNF/EBNF as llama.cpp writes it)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidRequestError(msg, "response_format")

        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            bad(f"structured output takes exactly one of json, json_object, regex, choice or grammar; got {given}")
        text = self.json or self.regex or self.grammar or ""
        if len(text.encode()) > MAX_GRAMMAR_BYTES:
            bad(f"the schema, regex or grammar has {len(text.encode())} bytes; at most {MAX_GRAMMAR_BYTES} are allowed")
        if self.choice is not None:
            if not 0 < len(self.choice) <= MAX_CHOICES or not all(isinstance(c, str) and c for c in self.choice):
                bad(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
            if sum(len(c.encode()) for c in self.choice) > MAX_GRAMMAR_BYTES:
                bad(f"the choices hold more than {MAX_GRAMMAR_BYTES} bytes")


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
    # Logprobs of each prompt token (the first has none), with this many top alternatives; computed in prefill,
    # so a request that asks is never served from the prefix cache.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0  # OpenAI: minus this once for each token already in the output
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # vLLM: logits of tokens in the prompt or output divided (>0) or multiplied by it
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit, clamped to [-100, 100]
    structured_output: StructuredOutput | None = None

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
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            bad(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}", "prompt_logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}", "repetition_penalty")
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}", "logit_bias")
            if any(not isinstance(t, int) or t < 0 for t in self.logit_bias):
                bad("logit_bias keys must be token ids (non-negative integers)", "logit_bias")
            if any(v != v for v in self.logit_bias.values()):
                bad("logit_bias values must be numbers in [-100, 100]", "logit_bias")
        if self.structured_output is not None:
            self.structured_output.validate()
            if self.min_tokens:
                bad("min_tokens cannot be combined with structured output: the grammar decides where the output "
                    "ends", "min_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def clamped_logit_bias(self) -> dict[int, float]:
        return {t: max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(v))) for t, v in (self.logit_bias or {}).items()}
