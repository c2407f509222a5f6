"""Generation deltas in OpenAI's shapes: whole responses, and SSE streams that end with `data: [DONE]`."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from deployments.errors import OpenAIError, internal_error
from deployments.generation import ChoiceDelta, Generation
from deployments.responses import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                   ChatCompletionResponse, ChatLogprobs, CompletionChoice, CompletionChunk,
                                   CompletionLogprobs, CompletionResponse, DeltaMessage, TokenLogprob, TopLogprob, Usage)
from deployments.timeline_recorder import inline_view
from engine.request import TokenLogprobs

log = logging.getLogger(__name__)
DONE = "data: [DONE]\n\n"


def sse(model: Any) -> str:
    return f"data: {model.model_dump_json()}\n\n"


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

    def completion_logprobs(self, entries: list[TokenLogprobs], offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for e in entries:
            text = self(e.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(e.logprob)
            out.top_logprobs.append({self(t): lp for t, lp in e.top})
            out.text_offset.append(offset)
            offset += len(text)
        return out


async def collect(generation: Generation) -> list[tuple[str, list[TokenLogprobs], str | None]]:
    """Each choice's whole text, logprob entries and finish reason."""
    texts = [""] * len(generation.choices)
    logprobs: list[list[TokenLogprobs]] = [[] for _ in generation.choices]
    async for deltas in generation.deltas():
        for d in deltas:
            texts[d.index] += d.text
            logprobs[d.index].extend(d.logprobs)
    return [(texts[i], logprobs[i], c.finish_reason) for i, c in enumerate(generation.choices)]


async def completion_response(generation: Generation, request_id: str, model: str, echo: str,
                              tokens: TokenText, want_logprobs: bool) -> CompletionResponse:
    choices = []
    for index, (text, entries, finish) in enumerate(await collect(generation)):
        logprobs = tokens.completion_logprobs(entries, len(echo)) if want_logprobs else None
        choices.append(CompletionChoice(index=index, text=echo + text, logprobs=logprobs, finish_reason=finish))
    return CompletionResponse(id=request_id, model=model, choices=choices, usage=generation.usage())


async def chat_response(generation: Generation, request_id: str, model: str, tokens: TokenText,
                        want_logprobs: bool) -> ChatCompletionResponse:
    choices = []
    for index, (text, entries, finish) in enumerate(await collect(generation)):
        logprobs = tokens.chat_logprobs(entries) if want_logprobs else None
        choices.append(ChatChoice(index=index, message=AssistantMessage(content=text), logprobs=logprobs,
                                  finish_reason=finish))
    return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=generation.usage())


async def completion_stream(generation: Generation, request_id: str, model: str, echo: str, tokens: TokenText,
                            want_logprobs: bool, include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())
    offsets = [len(echo)] * len(generation.choices)
    prefixes = [echo] * len(generation.choices)

    def chunk(d: ChoiceDelta) -> str:
        text = prefixes[d.index] + d.text
        prefixes[d.index] = ""
        logprobs = tokens.completion_logprobs(d.logprobs, offsets[d.index]) if want_logprobs else None
        offsets[d.index] += len(d.text)
        return sse(CompletionChunk(id=request_id, created=created, model=model, choices=[
            CompletionChoice(index=d.index, text=text, logprobs=logprobs, finish_reason=d.finish_reason)]))

    def usage() -> str:
        return sse(CompletionChunk(id=request_id, created=created, model=model, choices=[], usage=generation.usage()))

    def empty() -> BaseModel:
        return CompletionChunk(id=request_id, created=created, model=model, choices=[])

    async for text in _sse_events(generation, chunk, "", usage if include_usage else None, empty):
        yield text


async def chat_stream(generation: Generation, request_id: str, model: str, tokens: TokenText, want_logprobs: bool,
                      include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())

    def frame(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage))

    def chunk(d: ChoiceDelta) -> str:
        out = ""
        if d.text or d.logprobs or d.finish_reason is None:
            logprobs = tokens.chat_logprobs(d.logprobs) if want_logprobs else None
            out = frame([ChatChunkChoice(index=d.index, delta=DeltaMessage(content=d.text), logprobs=logprobs)])
        if d.finish_reason is not None:  # OpenAI closes each choice with an empty delta carrying the reason
            out += frame([ChatChunkChoice(index=d.index, delta=DeltaMessage(), finish_reason=d.finish_reason)])
        return out

    def usage() -> str:
        return frame([], generation.usage())

    def empty() -> BaseModel:
        return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[])

    opening = "".join(frame([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                      for i in range(len(generation.choices)))
    async for text in _sse_events(generation, chunk, opening, usage if include_usage else None, empty):
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
        pending += f"data: {json.dumps({**empty().model_dump(), 'timeline': timeline})}\n\n"
    yield pending + DONE
