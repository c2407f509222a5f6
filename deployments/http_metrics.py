"""Ingress HTTP metrics through Ray's metrics system: requests by route and status, latency, requests in flight.

A plain ASGI middleware (not BaseHTTPMiddleware) so streamed bodies pass through untouched.
"""
from __future__ import annotations

import time
from typing import Any

from ray.util import metrics

from deployments.context import replica_id

# Bounded label values: any other path counts as "other".
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health")
HTTP_LATENCY_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 5, 10, 30, 60, 120, 300]


class HttpMetricsMiddleware:
    """Built by Starlette inside the replica on its first request, so the metrics live in the replica's process."""

    def __init__(self, app: Any) -> None:
        self.app = app
        tags = {"replica": replica_id()}
        self.requests = metrics.Counter("tokenline_http_requests", "HTTP requests by route, method and status code.",
                                        tag_keys=("replica", "route", "method", "status"))
        self.latency = metrics.Histogram("tokenline_http_request_duration_seconds",
                                         "Time from request start to the last body byte, in seconds.",
                                         boundaries=HTTP_LATENCY_BUCKETS, tag_keys=("replica", "route", "method"))
        self.first_byte = metrics.Histogram("tokenline_http_time_to_first_byte_seconds",
                                            "Time from request start to the response headers, in seconds.",
                                            boundaries=HTTP_LATENCY_BUCKETS, tag_keys=("replica", "route", "method"))
        self.in_progress = metrics.Gauge("tokenline_http_requests_in_progress", "HTTP requests being served.",
                                         tag_keys=("replica",))
        for metric in (self.requests, self.latency, self.first_byte, self.in_progress):
            metric.set_default_tags(tags)
        self._in_progress = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        tags = {"route": path if path in ROUTES else "other", "method": scope.get("method", "")}
        start = time.perf_counter()
        status = 500

        async def send_measured(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                self.first_byte.observe(time.perf_counter() - start, tags=tags)
            await send(message)

        self._in_progress += 1
        self.in_progress.set(self._in_progress)
        try:
            await self.app(scope, receive, send_measured)
        finally:
            self._in_progress -= 1
            self.in_progress.set(self._in_progress)
            self.latency.observe(time.perf_counter() - start, tags=tags)
            self.requests.inc(tags={**tags, "status": str(status)})
