"""The OpenAI wire format as a load generator needs it: request bodies and streamed (SSE) events."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from loadtests.records import ErrorDetails, RequestRecord, Usage

Endpoint = Literal["chat", "completions"]
ENDPOINT_PATHS: dict[str, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True)
class EndpointConfig:
    """Where and how to send requests; the same for every request of a run."""

    base_url: str
    model: str
    endpoint: Endpoint = "chat"
    api_key: str | None = None
    streaming: bool = True
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request body (e.g. temperature, min_tokens)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINT_PATHS[self.endpoint]

    def headers(self, request_id: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Request-ID": request_id}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "stream": self.streaming}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if self.streaming:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM-style extension; servers without it ignore or reject the field
        body.update(self.extra_body)
        return body


@dataclass(frozen=True)
class StreamEvent:
    """One `data:` line of a streamed response."""

    content: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    done: bool = False
    error: str | None = None


DONE = StreamEvent(done=True)


def parse_usage(raw: dict[str, Any] | None) -> Usage | None:
    if not raw:
        return None
    details = raw.get("prompt_tokens_details") or {}
    return Usage(raw.get("prompt_tokens"), raw.get("completion_tokens"), raw.get("total_tokens"),
                 details.get("cached_tokens"))


def choice_content(choice: dict[str, Any]) -> str:
    """Generated text of one choice: chat delta/message content or completion text."""
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    if "message" in choice:
        return (choice["message"] or {}).get("content") or ""
    return choice.get("text") or ""


def parse_sse_line(line: bytes) -> StreamEvent | None:
    """A `data:` line as an event; None for blank lines, comments and other SSE fields."""
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return DONE
    if not payload:
        return None
    obj = json.loads(payload)
    if "error" in obj:
        err = obj["error"]
        return StreamEvent(error=err.get("message", str(err)) if isinstance(err, dict) else str(err))
    choices = obj.get("choices") or ()
    content, finish = "", None
    if choices:
        content = choice_content(choices[0])
        finish = choices[0].get("finish_reason")
    return StreamEvent(content, finish, parse_usage(obj.get("usage")))


def parse_full_response(obj: dict[str, Any]) -> StreamEvent:
    """A non-streamed response body as a single event."""
    choices = obj.get("choices") or ()
    content = choice_content(choices[0]) if choices else ""
    finish = choices[0].get("finish_reason") if choices else None
    return StreamEvent(content, finish, parse_usage(obj.get("usage")), done=True)


def error_message(status: int, body: bytes) -> str:
    """The server's OpenAI-shaped error message, or the start of the body."""
    try:
        obj = json.loads(body)
        err = obj.get("error", obj)
        msg = err.get("message") if isinstance(err, dict) else str(err)
        return f"HTTP {status}: {msg}"
    except (ValueError, AttributeError):
        return f"HTTP {status}: {body[:300].decode(errors='replace')}"


class StreamRecorder:
    """Feeds one streamed response's SSE lines into its RequestRecord: chunk times, text, finish reason, usage.

    Shared by the async runner and the Locust users, which differ only in how they read lines.
    """

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.parts: list[str] = []
        self.completed = False

    def feed(self, line: bytes | str) -> bool:
        """Takes one line; True once the stream is over ([DONE] or an error event)."""
        event = parse_sse_line(line)
        if event is None:
            return False
        now = time.perf_counter_ns()
        if event.done:
            self.completed = True
            return True
        if event.error is not None:
            self.record.error = ErrorDetails(500, "StreamError", event.error)
            return True
        if event.content:
            self.record.chunk_perf_ns.append(now)
            self.record.chunk_chars.append(len(event.content))
            self.parts.append(event.content)
        if event.finish_reason:
            self.record.finish_reason = event.finish_reason
        if event.usage is not None:
            self.record.usage = event.usage
        return False

    def close(self) -> None:
        record = self.record
        record.output_text = "".join(self.parts)
        if not self.completed and record.error is None and record.finish_reason is None:
            record.error = ErrorDetails(0, "IncompleteStream", "the stream ended without a finish reason or [DONE]")
