"""A request's timeline: the ingress's own marks joined with its engine replica's events, by durations only.

The ingress and each engine replica read their own `time.monotonic()`; no timestamp is compared across processes.
The replica reports offsets from the moment `generate` was called there; the ingress knows how long it waited
between handing the request to Serve and reading the final chunk. The difference is time spent between the two
processes (Serve's routing, Ray's hops there and back), split evenly between the two directions, since one-way
times cannot be told apart without a shared clock (bounded so that every event stays in order).

Stages, in order; each starts where the previous one ends, so together they make the ingress's own total:

  tokenize     arrival at the ingress → prompt token ids ready (body read and validated, chat template, tokenizer)
  dispatch     → the EngineRequest handed to Serve
  route        → the router chose a replica (PrefixAwareRouter runs in the ingress's process; none with power_of_two)
  to_engine    → `generate` called on the replica (half the round trip, above)
  admit        → enqueued in the scheduler (validation; the step thread takes new requests between steps)
  queue        → first scheduled
  prefill      → first token (prefill_chunk events inside, with their token counts)
  preempted    preempted → scheduled again; prefill (or decode, after the first token) resumes
  decode       → finished (decode steps are counted, not listed)
  emit         → the final chunk handed to Serve by the replica
  from_engine  → the final chunk read by the ingress (the rest of the round trip)
  respond      → the response complete (the tail detokenized, usage, the body built)
  send         → its last byte handed to the HTTP server (stored timelines only: an inline one rides in that byte)

A stream cut short at the ingress (a stop string, a client gone, an error) has no engine breakdown: one `engine`
stage covers the time from dispatch (or route) to the last chunk read.
The time between the client and the ingress (Serve's HTTP proxy) is outside every timeline.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from pydantic import BaseModel

from deployments.lru import BoundedLRU
from deployments.records import EngineTimeline
from engine.request import EventKind, RequestStatus

_ENGINE_STAGE_AFTER = {EventKind.ENQUEUED: "queue", EventKind.SCHEDULED: "prefill", EventKind.FIRST_TOKEN: "decode",
                       EventKind.PREEMPTED: "preempted", EventKind.FINISHED: "emit"}


@dataclass
class RoutingNote:
    """What the router decided for one request, in the ingress's process and clock."""

    replica_id: str
    expected_cached_tokens: int
    at: float  # time.monotonic()


class RoutingNotes:
    """The router's decision per request id, kept until the ingress joins the request's timeline.

    The router runs in the ingress's process (on Serve's router thread), so its clock is the ingress's clock.
    Bounded: notes nobody collects (timelines off, requests that failed) fall out oldest first.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self._notes: BoundedLRU[str, RoutingNote] = BoundedLRU(capacity)
        self._lock = threading.Lock()

    def put(self, request_id: str, note: RoutingNote) -> None:
        with self._lock:
            self._notes.put(request_id, note)

    def pop(self, request_id: str) -> RoutingNote | None:
        with self._lock:
            return self._notes.pop(request_id, None)

    def peek(self, request_id: str) -> RoutingNote | None:
        with self._lock:
            return self._notes.get(request_id)


ROUTING_NOTES = RoutingNotes()


def note_routing(request_id: str, note: RoutingNote) -> None:
    ROUTING_NOTES.put(request_id, note)


class Stage(BaseModel):
    stage: str
    start_s: float  # from arrival at the ingress
    duration_s: float


class Event(BaseModel):
    t_s: float  # from arrival at the ingress; engine events placed through the joined durations
    event: str
    process: str  # "ingress" | "engine"
    tokens: int | None = None  # prefill_chunk
    reason: str | None = None  # finished
    replica_id: str | None = None  # routed
    expected_cached_tokens: int | None = None  # routed


class TimelineView(BaseModel):
    """What a client receives: inline with its response, or from GET /v1/timelines/{request_id}."""

    request_id: str
    arrival_time: float  # the ingress's time.time() at arrival
    total_s: float  # the sum of the stages: arrival → response complete (→ last byte, when stored)
    time_to_first_chunk_s: float | None
    replica_id: str | None
    routed_replica_id: str | None
    expected_cached_tokens: int | None
    cached_tokens: int | None
    decode_steps: int | None
    preemptions: int | None
    finish_reason: str | None
    complete: bool  # the engine's breakdown is in (False: the stream was cut short at the ingress)
    last_byte: bool  # the `send` stage is in
    dropped_events: int
    stages: list[Stage]
    events: list[Event]


class RequestTimeline:
    """The ingress's marks for one HTTP request (time.monotonic() of its process) and what the engine sent back."""

    def __init__(self, wanted: bool) -> None:
        self.wanted = wanted  # the client asked for it inline
        self.arrival_time = time.time()
        self.arrived = time.monotonic()
        self.request_id: str | None = None
        self.tokenized = self.sent = self.first_chunk = self.last_chunk = None
        self.responded = self.last_byte = None
        self.engine: EngineTimeline | None = None
        self.engine_read: float | None = None
        self.routing: RoutingNote | None = None

    def prompt_ready(self) -> None:
        self.tokenized = time.monotonic()

    def dispatching(self, request_id: str) -> None:
        """Just before the request is handed to Serve (so the router's note always comes after it)."""
        self.request_id = request_id
        self.sent = time.monotonic()

    def chunk_read(self) -> None:
        self.last_chunk = time.monotonic()
        if self.first_chunk is None:
            self.first_chunk = self.last_chunk

    def engine_finished(self, engine: EngineTimeline) -> None:
        """A choice's final chunk carried its engine timeline; with several choices the last one to finish wins."""
        self.engine = engine
        self.engine_read = self.last_chunk

    def response_ready(self) -> None:
        if self.responded is None:
            self.responded = time.monotonic()

    def last_byte_sent(self) -> None:
        self.last_byte = time.monotonic()

    def view(self) -> TimelineView:
        if self.routing is None and self.request_id is not None:
            self.routing = ROUTING_NOTES.pop(self.request_id)
        return join(self)


class TimelineOff:
    """Stands in for RequestTimeline when timelines are off, or outside an HTTP request: every mark is a no-op."""

    wanted = False
    request_id = None

    def prompt_ready(self) -> None: ...
    def dispatching(self, request_id: str) -> None: ...
    def chunk_read(self) -> None: ...
    def engine_finished(self, engine: EngineTimeline) -> None: ...
    def response_ready(self) -> None: ...
    def last_byte_sent(self) -> None: ...


TIMELINE_OFF = TimelineOff()


def join(t: RequestTimeline) -> TimelineView:
    """The stages and events of one request, laid out on the ingress's clock from its arrival."""
    origin = t.arrived
    stages: list[Stage] = []
    events = [Event(t_s=0.0, event="arrived", process="ingress")]
    cursor = origin

    def stage(name: str, end: float) -> None:
        nonlocal cursor
        end = max(end, cursor)
        stages.append(Stage(stage=name, start_s=cursor - origin, duration_s=end - cursor))
        cursor = end

    def event(name: str, at: float, process: str = "ingress", **fields) -> None:
        events.append(Event(t_s=at - origin, event=name, process=process, **fields))

    def ingress_mark(stage_name: str, event_name: str, at: float | None) -> None:
        """An ingress stage that ends at a mark of its own, and the mark as an event (when it was reached)."""
        if at is not None:
            stage(stage_name, at)
            event(event_name, at)

    end = t.last_byte or t.responded or t.last_chunk or time.monotonic()
    ingress_mark("tokenize", "tokenized", t.tokenized)
    ingress_mark("dispatch", "sent", t.sent)
    base = t.sent
    routing = t.routing
    if routing is not None and base is not None and base <= routing.at <= end:
        stage("route", routing.at)
        event("routed", routing.at, replica_id=routing.replica_id,
              expected_cached_tokens=routing.expected_cached_tokens)
        base = routing.at
    engine, read = t.engine, t.engine_read
    if engine is not None and read is not None and base is not None:
        _engine_stages(t, engine, base, read, stage, event)
    elif base is not None and t.last_chunk is not None:
        stage("engine", t.last_chunk)
    if t.first_chunk is not None:
        event("first_chunk", t.first_chunk)
    if t.last_chunk is not None:
        event("last_chunk", t.last_chunk)
    ingress_mark("respond", "responded", t.responded)
    ingress_mark("send", "last_byte", t.last_byte)
    events.sort(key=lambda e: e.t_s)
    return TimelineView(
        request_id=t.request_id or "", arrival_time=t.arrival_time, total_s=cursor - origin,
        time_to_first_chunk_s=None if t.first_chunk is None else t.first_chunk - origin,
        replica_id=engine.replica_id if engine else None,
        routed_replica_id=routing.replica_id if routing else None,
        expected_cached_tokens=routing.expected_cached_tokens if routing else None,
        cached_tokens=engine.num_cached_tokens if engine else None,
        decode_steps=engine.num_decode_steps if engine else None,
        preemptions=engine.num_preemptions if engine else None,
        finish_reason=_finish_reason(engine), complete=engine is not None and read is not None,
        last_byte=t.last_byte is not None, dropped_events=engine.num_dropped_events if engine else 0,
        stages=stages, events=events)


def _engine_stages(t: RequestTimeline, engine: EngineTimeline, base: float, read: float, stage, event) -> None:
    """to_engine, the replica's own stages and from_engine, between `base` (sent or routed) and `read`."""
    round_trip = read - base - engine.end_s  # beyond the replica's own time, for the whole stream
    first_trip = (t.first_chunk or read) - base - engine.first_chunk_s
    to_engine = max(min(first_trip, round_trip) / 2, 0.0)
    received = base + to_engine
    stage("to_engine", received)
    event("received", received, "engine")
    current, decoding = "admit", False
    for offset, kind, value in engine.events:
        at = received + offset
        kind = EventKind(kind)
        if kind == EventKind.PREFILL_CHUNK:
            event("prefill_chunk", at, "engine", tokens=value)
        elif kind == EventKind.FINISHED:
            event("finished", at, "engine", reason=RequestStatus(value).finish_reason)
        else:
            event(kind.name.lower(), at, "engine")
        decoding = decoding or kind == EventKind.FIRST_TOKEN
        following = ("decode" if decoding else "prefill") if kind == EventKind.RESUMED else \
            _ENGINE_STAGE_AFTER.get(kind)
        if following is not None:
            stage(current, at)
            current = following
    stage(current, received + engine.end_s)
    event("final_chunk_out", received + engine.end_s, "engine")
    stage("from_engine", read)


def _finish_reason(engine: EngineTimeline | None) -> str | None:
    if engine is None:
        return None
    for _, kind, value in reversed(engine.events):
        if kind == EventKind.FINISHED:
            return RequestStatus(value).finish_reason
    return None
