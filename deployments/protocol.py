"""OpenAI request schemas (pydantic), with the sampling extensions vLLM offers, and their SamplingParams.

The schemas check shapes and types, and what only the API defines (temperature's OpenAI range, unsupported
fields); every bound the engine enforces is the engine's own check (engine.request_limits), run by the ingress.
"""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling_params import InvalidRequestError, SamplingParams


def _holds_lone_surrogate(value: object) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, BaseModel):
        return any(_holds_lone_surrogate(getattr(value, name)) for name in type(value).model_fields)
    if isinstance(value, dict):
        return any(_holds_lone_surrogate(k) or _holds_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_holds_lone_surrogate(v) for v in value)
    return False


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields both endpoints share; unknown fields are ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # Extensions, as vLLM names them.
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    # Engine fields this endpoint names otherwise, for errors: the client must recognise what to change.
    FIELD_NAMES: ClassVar[dict[str, str]] = {}

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def field_name(self, engine_param: str | None) -> str | None:
        return self.FIELD_NAMES.get(engine_param, engine_param)

    def check_supported(self) -> None:
        """Parameters accepted by the schema that this server cannot honour are refused, not silently dropped."""
        if self.presence_penalty or self.frequency_penalty:
            param = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise InvalidRequestError(f"{param} is not supported by this server; leave it at 0", param)
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported by this server", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")
        for name in type(self).model_fields:
            if _holds_lone_surrogate(getattr(self, name)):  # JSON allows "\ud800"; no tokenizer can encode it
                raise InvalidRequestError(f"{name} holds a lone UTF-16 surrogate (like \\ud800), which is not text",
                                          name)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Unchecked: RequestLimits.check (with the engine's limits) checks the whole request."""
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, min_p=self.min_p or 0.0,
            seed=self.seed, stop_token_ids=list(self.stop_token_ids or []), stop=self.stop_strings(),
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, logprobs=logprobs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request; batches of prompts are refused with a message saying so."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequestError(f"send one prompt per request; got a batch of {len(prompt)}", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str) and not prompt:
            raise InvalidRequestError("the prompt is empty; send at least one token", "prompt")
        if isinstance(prompt, list) and not prompt:
            raise InvalidRequestError("the prompt is empty; send at least one token", "prompt")
        return prompt

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise InvalidRequestError("suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of is not supported by this server; use n", "best_of")
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError("echo with logprobs is not supported: prompt logprobs are not computed",
                                      "echo")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    response_format: dict | None = None
    add_generation_prompt: bool = True

    FIELD_NAMES: ClassVar[dict[str, str]] = {"logprobs": "top_logprobs"}

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def field_name(self, engine_param: str | None) -> str | None:
        if engine_param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super().field_name(engine_param)

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise InvalidRequestError("tools are not supported by this server", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError("only response_format {\"type\": \"text\"} is supported", "response_format")
