"""The ingress's bounds on their own: header checks, and the deadline the middleware hands to the handler."""
from __future__ import annotations

import asyncio
import time

import pytest

from deployments.errors import OpenAIError
from deployments.limits import LimitsArgs, RequestLimitsMiddleware, _check_headers, configure, request_deadline


def scope(**headers: str) -> dict:
    return {"type": "http", "method": "POST", "path": "/v1/completions",
            "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}


def test_headers_set_the_deadline_and_refuse_what_they_show_is_wrong():
    limits = LimitsArgs(request_timeout_s=30, max_body_bytes=1024)
    assert _check_headers(scope(content_type="application/json"), limits) == 30
    assert _check_headers(scope(x_request_timeout="2.5"), limits) == 2.5
    assert _check_headers(scope(x_request_timeout="900"), limits) == 30  # a client may shorten, never extend
    for headers, status in (({"content_length": "4096"}, 413), ({"content_type": "text/plain"}, 415),
                            ({"x_request_timeout": "0"}, 400), ({"x_request_timeout": "inf"}, 400)):
        with pytest.raises(OpenAIError) as refused:
            _check_headers(scope(**headers), limits)
        assert refused.value.status == status, headers


def test_the_handler_sees_its_absolute_deadline_and_a_replica_drains_at_least_that_long():
    seen: list[float | None] = []

    async def app(scope, receive, send):
        seen.append(request_deadline())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        pass

    configure(LimitsArgs(request_timeout_s=30))
    try:
        middleware = RequestLimitsMiddleware(app)
        start = time.time()
        asyncio.run(middleware(scope(x_request_timeout="2.5"), receive, send))
        asyncio.run(middleware(scope(), receive, send))
    finally:
        configure(LimitsArgs())
    assert seen[0] == pytest.approx(start + 2.5, abs=0.5) and seen[1] == pytest.approx(start + 30, abs=0.5)
    assert request_deadline() is None  # outside a request
    assert LimitsArgs(request_timeout_s=600, graceful_shutdown_timeout_s=30).drain_s == 600
    assert LimitsArgs(request_timeout_s=10, graceful_shutdown_timeout_s=30).drain_s == 30
