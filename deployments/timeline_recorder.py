"""Timelines at the ingress: an ASGI middleware opens one per completion request, and on its last byte the
recorder feeds the stage histograms and keeps the timeline in a bounded store for GET /v1/timelines/{id}.

The middleware sits just inside the HTTP metrics one and outside the request limits, so `arrived` is taken before
any limit acts on the request. Handlers reach
the request's timeline through a context variable (`current_timeline()`); outside a request, or with timelines
off, they get TIMELINE_OFF, whose marks do nothing. The store is per ingress replica: with several, a GET may
land on one that never saw the request and answer 404 (ask for the timeline inline to be sure of it).
"""
from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Any

from ray.util import metrics

from deployments.engine_metrics import TTFT_BUCKETS
from deployments.errors import OpenAIError
from deployments.lru import BoundedLRU
from deployments.timeline import TIMELINE_OFF, RequestTimeline, TimelineOff, TimelineView
from deployments.timeline_config import TimelineArgs

log = logging.getLogger(__name__)

TIMELINE_HEADER = b"x-tokenline-timeline"
TIMELINE_ROUTES = ("/v1/completions", "/v1/chat/completions")
# The engine's own histograms already hold these (request_queue/prefill/decode_time_seconds): not repeated here.
ENGINE_MEASURED = frozenset({"queue", "prefill", "decode"})

_current: ContextVar[RequestTimeline | TimelineOff] = ContextVar("tokenline_timeline", default=TIMELINE_OFF)


def current_timeline() -> RequestTimeline | TimelineOff:
    return _current.get()


class StageMetrics:
    """`tokenline_request_stage_seconds{stage=...}`: every stage of the timeline the engine does not measure."""

    def __init__(self, model_name: str) -> None:
        self.stage_time = metrics.Histogram(
            "tokenline_request_stage_seconds", "Time per request in each stage of its timeline, in seconds.",
            boundaries=TTFT_BUCKETS, tag_keys=("model_name", "stage"))
        self.stage_time.set_default_tags({"model_name": model_name})

    def observe(self, view: TimelineView) -> None:
        for stage in view.stages:
            if stage.stage not in ENGINE_MEASURED:
                self.stage_time.observe(stage.duration_s, tags={"stage": stage.stage})


class TimelineStore:
    """The most recent timelines by request id (LRU, bounded)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._timelines: BoundedLRU[str, RequestTimeline] = BoundedLRU(capacity)

    def put(self, timeline: RequestTimeline) -> None:
        self._timelines.put(timeline.request_id, timeline)

    def get(self, request_id: str) -> RequestTimeline | None:
        return self._timelines.get(request_id)

    def since(self, wall_time: float) -> list[RequestTimeline]:
        return [t for t in self._timelines.values() if t.arrival_time >= wall_time]


class TimelineRecorder:
    def __init__(self, args: TimelineArgs, model_name: str) -> None:
        self.enabled = args.enabled
        self.store = TimelineStore(args.store_size)
        self.metrics = StageMetrics(model_name) if args.enabled else None

    def keep(self, timeline: RequestTimeline) -> None:
        """Stored (the same object, so what happens to it later shows), before the response's last byte goes: a
        client that asks for it as soon as it has read the response finds it."""
        if timeline.request_id is not None:  # None: refused before it was sent to an engine, nothing to show
            self.store.put(timeline)

    def finish(self, timeline: RequestTimeline) -> None:
        if timeline.request_id is None:
            return
        self.metrics.observe(timeline.view())
        self.store.put(timeline)

    def lookup(self, request_id: str) -> TimelineView:
        if not self.enabled:
            raise OpenAIError(404, "request timelines are off (timeline.enabled: false)", "request_id",
                              "timelines_disabled")
        timeline = self.store.get(request_id)
        if timeline is None:
            raise OpenAIError(404, f"no timeline for {request_id!r} on this ingress replica: it keeps the "
                                   f"{self.store.capacity} most recent; ask for it inline with the "
                                   f"X-Tokenline-Timeline: 1 header", "request_id", "timeline_not_found")
        return timeline.view()


_recorder: TimelineRecorder | None = None


def configure(args: TimelineArgs, model_name: str) -> TimelineRecorder:
    """Called by the ingress at start: one ingress per process, so one recorder per process."""
    global _recorder
    _recorder = TimelineRecorder(args, model_name)
    return _recorder


def inline_view(timeline: RequestTimeline | TimelineOff) -> dict[str, Any] | None:
    """Marks the response ready; the timeline as JSON when the client asked for it inline, else None."""
    timeline.response_ready()
    return timeline.view().model_dump() if timeline.wanted else None


def _asks_for_timeline(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(name == TIMELINE_HEADER and value.strip() in (b"1", b"true") for name, value in headers)


class TimelineMiddleware:
    """Plain ASGI (streamed bodies pass through untouched); inside HttpMetricsMiddleware, outside the limits."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        rec = _recorder
        if scope["type"] != "http" or rec is None or not rec.enabled or scope.get("path") not in TIMELINE_ROUTES:
            await self.app(scope, receive, send)
            return
        timeline = RequestTimeline(wanted=_asks_for_timeline(scope.get("headers", [])))
        token = _current.set(timeline)

        async def send_timed(message: dict) -> None:
            last = message["type"] == "http.response.body" and not message.get("more_body", False)
            if last:
                try:
                    rec.keep(timeline)
                except Exception:  # as below: never fail the request
                    log.exception("keeping the timeline of %s failed", timeline.request_id)
            await send(message)
            if last:
                timeline.last_byte_sent()

        try:
            await self.app(scope, receive, send_timed)
        finally:
            _current.reset(token)
            try:
                rec.finish(timeline)
            except Exception:  # a timeline must never fail the request it describes
                log.exception("recording the timeline of %s failed", timeline.request_id)
