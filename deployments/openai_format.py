"""Generation deltas in OpenAI's shapes: whole responses, and SSE streams that end with `data: [DONE]`."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from deployments.errors import OpenAIError, internal_error
from deployments.generation import ChoiceDelta, Generation
from deployments.responses import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                   ChatCompletionResponse, ChatLogprobs, CompletionChoice, CompletionChunk,
                                   CompletionLogprobs, CompletionResponse, DeltaMessage, FunctionCallOut,
                                   FunctionDelta, TokenLogprob, ToolCall, ToolCallChunk, TopLogprob, Usage)
from deployments.tool_calls import NamedCallParser, ParserStep, ToolCallParser
from deployments.timeline_recorder import inline_view
from engine.request import TokenLogprobs

log = logging.getLogger(__name__)
DONE = "data: [DONE]\n\n"
ToolParserFactory = Callable[[], ToolCallParser | NamedCallParser]


@dataclass
class Echo:
    """A completion prompt sent back before its choices' text; its tokens' logprobs too when asked for."""

    text: str
    token_ids: list[int]


@dataclass
class StreamUsage:
    """stream_options: a final usage chunk, and (vLLM's continuous_usage_stats) the usage so far on every chunk."""

    final: bool = False
    continuous: bool = False


# Characters JSON leaves raw in strings but `str.splitlines` (httpx's `aiter_lines`, many hand-written SSE readers)
# treats as line ends: escaped, so one event is always one line. JSON-equivalent; SSE itself only splits on CR/LF.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(text: str) -> str:
    return f"data: {text.translate(_LINE_BREAKS_JSON_KEEPS)}\n\n"


def sse(model: Any) -> str:
    return sse_json(model.model_dump_json())


def json_response(response: BaseModel, generation: Generation) -> JSONResponse:
    """The whole response; with a `timeline` field when the client asked for it (OpenAI clients ignore it)."""
    content = response.model_dump()
    timeline = inline_view(generation.timeline)
    if timeline is not None:
        content["timeline"] = timeline
    return JSONResponse(content)


class TokenText:
    """Token strings for logprobs, decoded one token at a time as OpenAI reports them."""

    def __init__(self, tokenizer: Any) -> None:
        self._backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._backend.decode([token_id], skip_special_tokens=False)
        return text

    def chat_logprobs(self, entries: list[TokenLogprobs]) -> ChatLogprobs:
        def top(token_id: int, logprob: float) -> TopLogprob:
            text = self(token_id)
            return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

        return ChatLogprobs(content=[TokenLogprob(**top(e.token_id, e.logprob).model_dump(),
                                                  top_logprobs=[top(t, lp) for t, lp in e.top])
                                     for e in entries])

    def completion_logprobs(self, entries: list[TokenLogprobs], offset: int,
                            echo: Echo | None = None, prompt_entries: list[TokenLogprobs] | None = None
                            ) -> CompletionLogprobs:
        """The legacy shape; with an echo, its prompt tokens come first (the first one has no logprob)."""
        out = CompletionLogprobs()
        if echo is not None:
            offset = 0
            for i, token_id in enumerate(echo.token_ids):
                text = self(token_id)
                e = prompt_entries[i - 1] if 0 < i <= len(prompt_entries or []) else None
                out.tokens.append(text)
                out.token_logprobs.append(e.logprob if e else None)
                out.top_logprobs.append({self(t): lp for t, lp in e.top} if e else None)
                out.text_offset.append(offset)
                offset += len(text)
            offset = len(echo.text)
        for e in entries:
            text = self(e.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(e.logprob)
            out.top_logprobs.append({self(t): lp for t, lp in e.top})
            out.text_offset.append(offset)
            offset += len(text)
        return out


@dataclass
class CollectedChoice:
    text: str
    logprobs: list[TokenLogprobs]
    finish_reason: str | None
    prompt_logprobs: list[TokenLogprobs]


async def collect(generation: Generation) -> list[CollectedChoice]:
    """Each choice's whole text, logprob entries, finish reason and prompt logprobs."""
    out = [CollectedChoice("", [], None, []) for _ in generation.choices]
    async for deltas in generation.deltas():
        for d in deltas:
            out[d.index].text += d.text
            out[d.index].logprobs.extend(d.logprobs)
            out[d.index].prompt_logprobs.extend(d.prompt_logprobs)
    for choice, state in zip(out, generation.choices):
        choice.finish_reason = state.finish_reason
    return out


async def completion_response(generation: Generation, request_id: str, model: str, echoes: list[Echo] | None,
                              n: int, tokens: TokenText, want_logprobs: bool) -> CompletionResponse:
    choices = []
    for index, c in enumerate(await collect(generation)):
        echo = echoes[index // n] if echoes else None
        prefix = echo.text if echo else ""
        logprobs = tokens.completion_logprobs(c.logprobs, len(prefix), echo, c.prompt_logprobs) \
            if want_logprobs else None
        choices.append(CompletionChoice(index=index, text=prefix + c.text, logprobs=logprobs,
                                        finish_reason=c.finish_reason))
    return CompletionResponse(id=request_id, model=model, choices=choices, usage=generation.usage())


def tool_message(parser: ToolCallParser | NamedCallParser, text: str) -> tuple[str, list[ToolCall]]:
    """A whole answer split into content and calls."""
    content = parser.push(text).content + parser.finish().content
    return content, [ToolCall(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                     for c in parser.calls]


def _finish_with_calls(finish_reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason


async def chat_response(generation: Generation, request_id: str, model: str, tokens: TokenText,
                        want_logprobs: bool, tool_parser: ToolParserFactory | None = None) -> ChatCompletionResponse:
    choices = []
    for index, c in enumerate(await collect(generation)):
        logprobs = tokens.chat_logprobs(c.logprobs) if want_logprobs else None
        message, finish = AssistantMessage(content=c.text), c.finish_reason
        if tool_parser is not None:
            content, calls = tool_message(tool_parser(), c.text)
            message = AssistantMessage(content=content or None if calls else content, tool_calls=calls or None)
            finish = _finish_with_calls(finish, bool(calls))
        choices.append(ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=finish))
    return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=generation.usage())


async def completion_stream(generation: Generation, request_id: str, model: str, echoes: list[Echo] | None,
                            n: int, tokens: TokenText, want_logprobs: bool,
                            usage_options: StreamUsage) -> AsyncIterator[str]:
    created = int(time.time())
    choice_echoes = [echoes[i // n] if echoes else None for i in range(len(generation.choices))]
    offsets = [len(e.text) if e else 0 for e in choice_echoes]
    started = [False] * len(generation.choices)

    def chunk(d: ChoiceDelta) -> str:
        echo = None if started[d.index] else choice_echoes[d.index]
        started[d.index] = True
        text = (echo.text if echo else "") + d.text
        logprobs = tokens.completion_logprobs(d.logprobs, offsets[d.index], echo, d.prompt_logprobs) \
            if want_logprobs else None
        offsets[d.index] += len(d.text)
        return sse(CompletionChunk(id=request_id, created=created, model=model, choices=[
            CompletionChoice(index=d.index, text=text, logprobs=logprobs, finish_reason=d.finish_reason)],
            usage=generation.usage() if usage_options.continuous else None))

    def usage() -> str:
        return sse(CompletionChunk(id=request_id, created=created, model=model, choices=[], usage=generation.usage()))

    def empty() -> BaseModel:
        return CompletionChunk(id=request_id, created=created, model=model, choices=[])

    async for text in _sse_events(generation, chunk, "", usage if usage_options.final else None, empty):
        yield text


def _tool_call_chunks(step: ParserStep) -> list[ToolCallChunk] | None:
    chunks = [ToolCallChunk(index=c.index, id=c.id, type="function" if c.id else None,
                            function=FunctionDelta(name=c.name, arguments=c.arguments)) for c in step.calls]
    return chunks or None


async def chat_stream(generation: Generation, request_id: str, model: str, tokens: TokenText, want_logprobs: bool,
                      usage_options: StreamUsage, tool_parser: ToolParserFactory | None = None) -> AsyncIterator[str]:
    created = int(time.time())
    parsers = [tool_parser() for _ in generation.choices] if tool_parser is not None else None

    def frame(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        if usage is None and usage_options.continuous:
            usage = generation.usage()
        return sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage))

    def chunk(d: ChoiceDelta) -> str:
        out, content, calls, finish = "", d.text, None, d.finish_reason
        if parsers is not None:  # the text is split into content and tool-call deltas
            parser = parsers[d.index]
            step = parser.push(d.text)
            if finish is not None:
                end = parser.finish()
                step.content += end.content
                step.calls += end.calls
            content, calls = step.content, _tool_call_chunks(step)
            finish = _finish_with_calls(finish, bool(parser.calls))
        if content or calls or d.logprobs or finish is None:
            logprobs = tokens.chat_logprobs(d.logprobs) if want_logprobs else None
            delta = DeltaMessage(content=content if content or not calls else None, tool_calls=calls)
            out = frame([ChatChunkChoice(index=d.index, delta=delta, logprobs=logprobs)])
        if finish is not None:  # OpenAI closes each choice with an empty delta carrying the reason
            out += frame([ChatChunkChoice(index=d.index, delta=DeltaMessage(), finish_reason=finish)])
        return out

    def usage() -> str:
        return frame([], generation.usage())

    def empty() -> BaseModel:
        return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[])

    opening = "".join(frame([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                      for i in range(len(generation.choices)))
    async for text in _sse_events(generation, chunk, opening, usage if usage_options.final else None, empty):
        yield text


async def _sse_events(generation: Generation, chunk: Callable[[ChoiceDelta], str], opening: str,
                      usage: Callable[[], str] | None, empty: Callable[[], BaseModel]) -> AsyncIterator[str]:
    """One SSE write per engine message; an error after the first byte becomes an SSE error event, then [DONE].

    A client that asked for its timeline gets it in one more chunk before [DONE], with no choices (as the usage
    chunk has) and a `timeline` field that OpenAI clients keep as an extra attribute.
    """
    pending = opening
    try:
        async for deltas in generation.deltas():
            yield pending + "".join(chunk(d) for d in deltas)
            pending = ""
        if usage is not None:
            pending += usage()
    except OpenAIError as exc:
        log.warning("stream ended by an error: %s", exc)
        pending += sse(exc.body)
    except Exception:  # the headers are sent: the error can only travel as an event, and says nothing internal
        log.exception("stream failed")
        pending += sse(internal_error().body)
    timeline = inline_view(generation.timeline)
    if timeline is not None:
        pending += sse_json(json.dumps({**empty().model_dump(), 'timeline': timeline}))
    yield pending + DONE
