"""One request's stream from an engine replica, turned into per-choice text deltas, finish reasons and usage."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ray.serve.exceptions import BackPressureError

from deployments.detokenizer import IncrementalDetokenizer
from deployments.errors import OpenAIError
from deployments.limits import overloaded
from deployments.records import GenerationChunk, RequestRejected
from deployments.responses import PromptTokensDetails, Usage
from deployments.timeline import TIMELINE_OFF, RequestTimeline, TimelineOff
from engine.request import TokenLogprobs

log = logging.getLogger(__name__)

RETRY_SOON = {"Retry-After": "1"}  # a lost replica: Serve routes the retry to a live one


class ReplicaLost(OpenAIError):
    """The engine replica serving the request failed or went away; the request itself was fine."""

    def __init__(self) -> None:
        super().__init__(503, "the engine replica serving this request was lost; retry the request",
                         code="engine_replica_lost", headers=RETRY_SOON)


def rejection_error(rejected: RequestRejected) -> OpenAIError:
    """The HTTP error for an engine replica's refusal or failure report (its status and code, unchanged)."""
    if rejected.retry_after_s is not None:
        return overloaded(rejected.message, rejected.retry_after_s)
    return OpenAIError(rejected.status, rejected.message, rejected.param, rejected.code)


@dataclass
class ChoiceDelta:
    index: int
    text: str
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None  # set on the choice's last delta
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # on the first delta, when asked for


@dataclass
class ChoiceState:
    detokenizer: IncrementalDetokenizer
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    engine_finished: bool = False
    token_ids: list[int] = field(default_factory=list)


class Generation:
    """Reads the replica's stream; stops it early once every choice has met a stop string."""

    def __init__(self, responses: Any, n: int, prompt_lengths: list[int],
                 make_detokenizer: Callable[[int], IncrementalDetokenizer],
                 timeline: RequestTimeline | TimelineOff = TIMELINE_OFF) -> None:
        """`n` choices for each prompt (of `prompt_lengths` tokens); choice i * n + j is prompt i's j-th."""
        self._responses = responses  # a DeploymentResponseGenerator of list[GenerationChunk] | RequestRejected
        self.n = n
        self.prompt_lengths = prompt_lengths
        self.timeline = timeline
        self.choices = [ChoiceState(make_detokenizer(i)) for i in range(n * len(prompt_lengths))]
        self._first: list[GenerationChunk] | None = None

    async def start(self) -> None:
        """Waits for the first message, so a refused request becomes an HTTP error before any byte is sent."""
        first = await self._next()
        if first is None:
            raise OpenAIError(503, "the engine closed the stream before producing anything")
        self._first = first

    async def deltas(self) -> AsyncIterator[list[ChoiceDelta]]:
        try:
            batch = self._first
            self._first = None
            while batch is not None:
                deltas = [d for chunk in batch if (d := self._advance(chunk)) is not None]
                if deltas:
                    yield deltas
                if self.finished:
                    return
                batch = await self._next()
            if not self.finished:
                raise OpenAIError(503, "the engine stream ended before every choice finished")
        finally:
            self.cancel()

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def cancel(self) -> None:
        """Ends the replica's stream, aborting what still runs there, unless the engine already finished it."""
        if not all(c.engine_finished for c in self.choices):
            try:
                self._responses.cancel()
            except Exception as exc:  # Serve re-raises a routing failure (backpressure) from cancel()
                log.debug("cancelling the engine stream: %r", exc)

    def usage(self) -> Usage:
        """Each prompt counted once, however many choices it has."""
        completion = sum(c.num_output_tokens for c in self.choices)
        prompt = sum(self.prompt_lengths)
        n = self.n
        cached = sum(max(c.num_cached_tokens for c in self.choices[i * n:(i + 1) * n])
                     for i in range(len(self.prompt_lengths)))
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    async def _next(self) -> list[GenerationChunk] | None:
        try:
            message = await self._responses.__anext__()
        except StopAsyncIteration:
            for choice in self.choices:
                choice.engine_finished = True
            return None
        except OpenAIError:
            raise
        except BackPressureError as exc:  # every engine replica is full and so is the queue before them
            raise overloaded(f"every engine replica is busy and {exc.message}; retry shortly") from exc
        except Exception as exc:  # the replica failed or went away: the caller's input was fine
            log.warning("engine stream failed: %r", exc)
            raise ReplicaLost() from exc
        if isinstance(message, RequestRejected):
            raise rejection_error(message)
        self.timeline.chunk_read()
        return message

    def _advance(self, chunk: GenerationChunk) -> ChoiceDelta | None:
        choice, out = self.choices[chunk.index], chunk.output
        choice.engine_finished = out.finished
        if chunk.timeline is not None:
            self.timeline.engine_finished(chunk.timeline)
        if choice.finish_reason is not None:
            return None  # a stop string already ended this choice
        choice.num_cached_tokens = out.num_cached_tokens
        step = choice.detokenizer.push(out.new_token_ids)
        choice.token_ids.extend(out.new_token_ids[:step.num_tokens])
        choice.num_output_tokens += step.num_tokens
        text = step.text
        if step.stopped:
            choice.finish_reason = "stop"
        elif out.finished:
            choice.finish_reason = out.finish_reason or "stop"
            text += choice.detokenizer.flush()
        return ChoiceDelta(chunk.index, text, out.logprobs[:step.num_tokens], choice.finish_reason,
                           out.prompt_logprobs)

