"""Bounds on what one ingress replica takes on: body size, content type, requests at once, and each one's deadline.

A plain ASGI middleware (streamed bodies pass through untouched), inside the metrics middleware so its refusals
are counted. Every refusal is an OpenAI-shaped error; past `max_concurrent_requests` it answers 503 with
`Retry-After`. Whether a request can still be served in time is decided where its wait is known: each engine
replica admits by its own predicted backlog (deployments/engine_replica.py).

Deadlines: `limits.request_timeout_s`, or the shorter one a client asks for in the `X-Request-Timeout` header
(seconds). The absolute deadline travels with the request to the engine (`request_deadline()`), whose scheduler
drops a request still waiting at its deadline. Past it the handler is cancelled, which cancels the engine call
and so aborts the request and frees its blocks: work nobody waits for stops. A request that has not answered
yet gets 408; a stream already sent gets an SSE error event, then `[DONE]`.
"""
from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import math
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from deployments.errors import OpenAIError

log = logging.getLogger(__name__)

TIMEOUT_HEADER = b"x-request-timeout"
GUARDED_PREFIX = "/v1/"
ADMIT_WAIT_FRACTION = 0.8  # an engine replica refuses when its predicted wait passes this share of the time left
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("tokenline_deadline", default=None)


class LimitsArgs(BaseModel):
    """Bounds everywhere a request can wait, so overload is refused early instead of queued without end."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(4 << 20, ge=1024, description="request bodies past it get 413")
    max_concurrent_requests: int = Field(256, ge=1, description="/v1/* requests one ingress replica serves at "
                                                                 "once; past it 503 with Retry-After")
    request_timeout_s: float = Field(600.0, gt=0, description="deadline of each request; X-Request-Timeout "
                                                              "may shorten it")
    retry_after_s: int = Field(1, ge=0, description="the Retry-After sent with 429/503")
    engine_max_queued_requests: int = Field(256, ge=-1, description="requests an ingress replica holds while "
                                                                     "every engine replica is at its "
                                                                     "max_ongoing_requests (-1: no bound)")
    ingress_max_queued_requests: int = Field(512, ge=-1, description="requests the HTTP proxy holds while every "
                                                                      "ingress replica is full (-1: no bound)")
    graceful_shutdown_timeout_s: float = Field(30.0, ge=0, description="how long a replica being stopped (scale "
                                                                        "down, redeploy) drains in-flight "
                                                                        "requests; never less than "
                                                                        "request_timeout_s")

    @property
    def drain_s(self) -> float:
        """A replica being stopped drains for as long as a request may live: a scale-in never cuts a stream that
        would have finished within its deadline."""
        return max(self.graceful_shutdown_timeout_s, self.request_timeout_s)


class _BodyTooLarge(HTTPException):
    """Raised from `receive`: FastAPI re-raises HTTPExceptions met while reading the body, so it becomes a 413."""


_limits = LimitsArgs()


def configure(limits: LimitsArgs) -> None:
    """Called by the ingress at start; the middleware is built by Starlette later, on the first request."""
    global _limits
    _limits = limits


def request_deadline() -> float | None:
    """The time.time() by which the request being handled must be answered (set by the middleware)."""
    return _DEADLINE.get()


class RequestLimitsMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app
        self.num_in_flight = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith(GUARDED_PREFIX):
            await self.app(scope, receive, send)
            return
        limits = _limits
        try:
            timeout_s = _check_headers(scope, limits)
        except OpenAIError as exc:
            await _send_error(send, exc)
            return
        if self.num_in_flight >= limits.max_concurrent_requests:
            await _send_error(send, _overloaded(f"this server is at its limit of {limits.max_concurrent_requests} "
                                                f"requests at once; retry shortly", limits))
            return
        self.num_in_flight += 1
        token = _DEADLINE.set(time.time() + timeout_s)  # the handler's task copies this context
        try:
            await self._serve_with_deadline(scope, _limited_receive(receive, limits.max_body_bytes), send, timeout_s)
        finally:
            _DEADLINE.reset(token)
            self.num_in_flight -= 1

    async def _serve_with_deadline(self, scope: dict, receive: Any, send: Any, timeout_s: float) -> int | None:
        """Returns the response's status, or None when the deadline cut it."""
        started: dict[str, Any] = {}
        done = complete = False

        async def tracked_send(message: dict) -> None:
            nonlocal complete
            if done:
                return  # the deadline already closed this response
            if message["type"] == "http.response.start":
                started.update(message)
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        task = asyncio.ensure_future(self.app(scope, receive, tracked_send))
        try:
            finished, _ = await asyncio.wait({task}, timeout=timeout_s)
        except BaseException:  # the client went away (Serve cancels this call): take the handler with it
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        if finished:
            task.result()  # the handler's own exception, if any, goes on up
            return started.get("status")
        done = True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if complete:
            return started.get("status")
        error = OpenAIError(408, f"the request did not finish within its deadline of {timeout_s:g}s "
                                 f"(limits.request_timeout_s, or the X-Request-Timeout header)",
                            code="request_timeout")
        log.info("request to %s cancelled after %.1fs deadline", scope.get("path"), timeout_s)
        if not started:
            await _send_error(send, error)
        elif _is_event_stream(started):
            body = f"data: {json.dumps(error.body.model_dump())}\n\ndata: [DONE]\n\n".encode()
            await send({"type": "http.response.body", "body": body, "more_body": False})
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        return None


def _check_headers(scope: dict, limits: LimitsArgs) -> float:
    """Refuses what the headers alone show is wrong; returns the request's deadline in seconds."""
    headers = dict(scope.get("headers") or [])
    length = headers.get(b"content-length")
    if length is not None and (not length.isdigit() or int(length) > limits.max_body_bytes):
        raise _too_large(limits.max_body_bytes)
    content_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
    if scope.get("method") == "POST" and content_type and not (content_type == b"application/json"
                                                                or content_type.endswith(b"+json")):
        raise OpenAIError(415, f"Content-Type must be application/json, got "
                               f"{content_type.decode('latin-1')[:100]!r}", code="unsupported_media_type")
    timeout_s = limits.request_timeout_s
    asked = headers.get(TIMEOUT_HEADER)
    if asked is not None:
        try:
            value = float(asked)
        except ValueError:
            value = math.nan
        if not (value > 0 and math.isfinite(value)):
            raise OpenAIError(400, "X-Request-Timeout must be a positive number of seconds", "X-Request-Timeout")
        timeout_s = min(value, timeout_s)
    return timeout_s


def _limited_receive(receive: Any, max_bytes: int) -> Any:
    """Counts body bytes as they arrive: a chunked body declares no length up front."""
    received = 0

    async def limited() -> dict:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > max_bytes:
                raise _BodyTooLarge(413, _too_large(max_bytes).body.error.message)
        return message

    return limited


def _too_large(max_bytes: int) -> OpenAIError:
    return OpenAIError(413, f"the request body is larger than this server's limit of {max_bytes:,} bytes "
                            f"(limits.max_body_bytes)", code="request_too_large")


def _overloaded(message: str, limits: LimitsArgs, retry_after_s: float | None = None) -> OpenAIError:
    seconds = max(limits.retry_after_s, math.ceil(retry_after_s or 0))
    return OpenAIError(503, message, code="server_overloaded", headers={"Retry-After": str(seconds)})


def overloaded(message: str, retry_after_s: float | None = None) -> OpenAIError:
    """503 with a Retry-After of `retry_after_s` (at least this server's own): for queues that are full, or too
    slow for a deadline, anywhere behind the ingress."""
    return _overloaded(message, _limits, retry_after_s)


def _is_event_stream(start: dict) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.get("headers", []))


async def _send_error(send: Any, error: OpenAIError) -> None:
    response = error.response()
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": False})
