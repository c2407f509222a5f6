"""Per-request sampling parameters, validated before a request touches engine state.

`SamplingParams.validate` checks what a request asks for on its own; `engine.request_limits.RequestLimits.check`
adds what depends on the engine (vocabulary, context, KV pool). Both raise InvalidRequestError, whose `code`
travels to the client unchanged: nothing downstream matches message text.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_N = 16  # choices of one request
MAX_STOP_STRINGS = 8
MAX_STOP_STRING_CHARS = 256  # the detokenizer holds back this much text per choice while it matches
MAX_STOP_TOKEN_IDS = 64

SEED_SPAN = 2**64  # torch generators take 64 bits; OpenAI seeds are opaque integers, so larger ones wrap
MAX_LOGIT_BIAS = 300  # entries, as OpenAI bounds it
LOGIT_BIAS_LIMIT = 100.0  # each bias is clamped to [-100, 100]
MAX_GRAMMAR_BYTES = 64 * 1024  # a schema, regex or grammar; larger ones cost seconds to compile
MAX_CHOICES = 256


class InvalidRequestError(ValueError):
    """A request the engine will not accept; the message says what the caller must change.

    `param` names the request field at fault, `code` the kind of fault (for clients and for the HTTP layer, which
    answers with it as OpenAI's `code`)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def wrap_seed(seed: int) -> int:
    """Any integer into the signed 64-bit range, modulo 2**64: `seed + choice index` can never overflow."""
    return (seed + SEED_SPAN // 2) % SEED_SPAN - SEED_SPAN // 2


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
    stop: list[str] = field(default_factory=list)  # stop strings: matched on text by the caller, bounded here
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

    def __post_init__(self) -> None:
        if _is_int(self.seed):
            self.seed = wrap_seed(self.seed)

    def for_choice(self, index: int) -> "SamplingParams":
        """The parameters of choice `index` of a request: n seeded samples must differ, so each adds its index."""
        if not index or self.seed is None:
            return self
        return dataclasses.replace(self, seed=self.seed + index)

    def token_id_fields(self) -> dict[str, Iterable[int]]:
        """Every token id this request names, by field: each is checked against the vocabulary at the border.
        A field that carries token ids (logit_bias keys, allowed token ids) belongs here."""
        return {"stop_token_ids": self.stop_token_ids, "logit_bias": list(self.logit_bias or ())}

    def validate(self) -> None:
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p == 0:
            raise InvalidRequestError("top_p must be in (0, 1], got 0", "top_p")
        _check_int("top_k", self.top_k, low=-1)
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                                      f"({self.max_tokens})", "min_tokens")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r:.40}", "seed")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos must be true or false", "ignore_eos")
        _check_list("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS, "stop token ids")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative integers", "stop_token_ids",
                                      "invalid_token_id")
        _check_list("stop", self.stop, MAX_STOP_STRINGS, "stop sequences")
        for text in self.stop:
            if not isinstance(text, str) or not 0 < len(text) <= MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(f"each stop sequence must be text of 1 to {MAX_STOP_STRING_CHARS} "
                                          f"characters", "stop")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), low=-2.0, high=2.0)
        _check_number("repetition_penalty", self.repetition_penalty, low=0.0, high=2.0)
        if self.repetition_penalty == 0:
            raise InvalidRequestError("repetition_penalty must be in (0, 2], got 0", "repetition_penalty")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequestError("logit_bias must map token ids to biases", "logit_bias")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise InvalidRequestError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got "
                                          f"{len(self.logit_bias)}", "logit_bias")
            if not all(_is_int(t) and t >= 0 for t in self.logit_bias):
                raise InvalidRequestError("logit_bias keys must be token ids (non-negative integers)", "logit_bias",
                                          "invalid_token_id")
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                       for v in self.logit_bias.values()):
                raise InvalidRequestError("logit_bias values must be finite numbers (each is clamped to "
                                          "[-100, 100])", "logit_bias")
        if self.structured_output is not None:
            self.structured_output.validate()
            if self.min_tokens:
                raise InvalidRequestError("min_tokens cannot be combined with structured output: the grammar decides "
                                          "where the output ends", "min_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def clamped_logit_bias(self) -> dict[int, float]:
        return {t: max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(v))) for t, v in (self.logit_bias or {}).items()}

def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not _is_int(value) or value < low or (high is not None and value > high):
        bounds = f"between {low} and {high}" if high is not None else f"an integer of at least {low}"
        raise InvalidRequestError(f"{name} must be {bounds}, got {value!r:.40}", name)


def _check_number(name: str, value: object, low: float, high: float | None = None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (high is not None and value > high):
        bounds = f"in [{low:g}, {high:g}]" if high is not None else f"a finite number of at least {low:g}"
        raise InvalidRequestError(f"{name} must be {bounds}, got {value!r:.40}", name)


def _check_list(name: str, value: object, max_len: int, what: str) -> None:
    if not isinstance(value, list):
        raise InvalidRequestError(f"{name} must be a list", name)
    if len(value) > max_len:
        raise InvalidRequestError(f"at most {max_len} {what} are allowed, got {len(value)}", name)
