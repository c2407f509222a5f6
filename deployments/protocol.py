"""OpenAI request schemas (pydantic), with the sampling extensions vLLM offers, and their SamplingParams.

The schemas check shapes and types, and what only the API defines (temperature's OpenAI range, unsupported
fields); every bound the engine enforces is the engine's own check (engine.request_limits), run by the ingress.
"""
from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling_params import InvalidRequestError, SamplingParams, StructuredOutput

MAX_PROMPTS = 32  # prompts in one completions request
MAX_TOOLS = 128


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
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far


class JsonSchemaFormat(BaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


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
    response_format: ResponseFormat | None = None
    # Extensions, as vLLM names them.
    repetition_penalty: float = 1.0
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    # vLLM's: lower runs first (capped by the tenant's max_priority); blocks hash with the salt, so only requests
    # with the same salt (and tenant) share cached prefixes.
    priority: int | None = Field(None, ge=-1_000_000, le=1_000_000)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    # Engine fields this endpoint names otherwise, for errors: the client must recognise what to change.
    FIELD_NAMES: ClassVar[dict[str, str]] = {}

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def field_name(self, engine_param: str | None) -> str | None:
        return self.FIELD_NAMES.get(engine_param, engine_param)

    def check_supported(self) -> None:
        """Parameters accepted by the schema that this server cannot honour are refused, not silently dropped."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")
        for name in type(self).model_fields:
            if _holds_lone_surrogate(getattr(self, name)):  # JSON allows "\ud800"; no tokenizer can encode it
                raise InvalidRequestError(f"{name} holds a lone UTF-16 surrogate (like \\ud800), which is not text",
                                          name)

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                        structured: StructuredOutput | None = None) -> SamplingParams:
        """The engine's parameters, unchecked: RequestLimits.check (with the engine's limits) checks the whole
        request. `structured` (from tools) stands in for the request's own structured output."""
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, min_p=self.min_p or 0.0,
            seed=self.seed, stop_token_ids=list(self.stop_token_ids or []), stop=self.stop_strings(),
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self._logit_bias(),
            structured_output=structured or self.structured_output())

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(token): value for token, value in self.logit_bias.items()}
        except ValueError as exc:
            raise InvalidRequestError("logit_bias keys must be token ids (integers written as strings, like "
                                      "\"50256\")", "logit_bias") from exc

    def structured_output(self) -> StructuredOutput | None:
        """response_format or one of vLLM's guided_* fields; two at once are refused."""
        given = {name: getattr(self, name) for name in ("guided_json", "guided_regex", "guided_choice",
                                                          "guided_grammar") if getattr(self, name) is not None}
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            given["response_format"] = fmt
        if len(given) > 1:
            raise InvalidRequestError(f"give one kind of structured output, not {' and '.join(given)}",
                                      next(iter(given)))
        if "response_format" in given:
            if fmt.type == "json_object":
                return StructuredOutput(json_object=True)
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise InvalidRequestError("response_format json_schema needs json_schema.schema", "response_format")
            return StructuredOutput(json=json.dumps(fmt.json_schema.schema_))
        if self.guided_json is not None:
            text = self.guided_json if isinstance(self.guided_json, str) else json.dumps(self.guided_json)
            return StructuredOutput(json=text)
        if self.guided_choice is not None:
            return StructuredOutput(choice=tuple(self.guided_choice))
        if self.guided_regex is not None or self.guided_grammar is not None:
            return StructuredOutput(regex=self.guided_regex, grammar=self.guided_grammar)
        return None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of this request (a string, token ids, or a batch of either); choice i * n + j is prompt i's
        j-th sample, as OpenAI numbers them."""
        prompt = self.prompt
        batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        if len(batch) > MAX_PROMPTS:
            raise InvalidRequestError(f"at most {MAX_PROMPTS} prompts per request, got {len(batch)}", "prompt")
        if any(not p for p in batch):
            raise InvalidRequestError("the prompt is empty; send at least one token", "prompt")
        return batch

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise InvalidRequestError("suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of is not supported by this server; use n", "best_of")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallMessage(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = Field(None, max_length=MAX_TOOLS)  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the parameters are always enforced under required or a named tool_choice


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None  # OpenAI's legacy form of tools: refused, with a pointer to tools
    function_call: Any = None
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
        if self.functions is not None or self.function_call is not None:
            param = "functions" if self.functions is not None else "function_call"
            raise InvalidRequestError(f"{param} (legacy) is not supported; send tools and tool_choice", param)
        if self.tool_choice not in (None, "none") and not self.tools:
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise InvalidRequestError("tool names must be unique", "tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise InvalidRequestError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among "
                                      f"the tools ({', '.join(names)})", "tool_choice")

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: `auto` when tools are given, `none` otherwise."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the model's template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("send either prompt or messages", "prompt")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)
