"""Engine steps and request timelines as one Chrome trace (the trace-event JSON Perfetto and chrome://tracing open).

One process per engine replica: its engine steps on one track (a span per step, with the batch it ran; counters
for KV usage and queue lengths), and its requests on lanes below, a span per request with a span per stage inside
and instants for prefill chunks and preemptions. A request that never reached an engine sits under "ingress".
Times are microseconds from the window's start. Step times are each replica's clock, request times the
ingress's: on one machine they agree; across machines they differ by the nodes' clock offset.
"""
from __future__ import annotations

from typing import Any

from deployments.records import ReplicaSteps
from deployments.timeline import TimelineView
from engine.outputs import STEP_PHASES

STEPS_TID = 0
FIRST_LANE_TID = 1
INSTANT_EVENTS = {"prefill_chunk", "preempted", "resumed", "first_token"}


def chrome_trace(replicas: list[ReplicaSteps], timelines: list[TimelineView], since: float,
                 until: float) -> dict[str, Any]:
    """The trace of the window [since, until] (time.time() seconds)."""
    events: list[dict[str, Any]] = []
    pids: dict[str | None, int] = {None: 0}
    _process(events, 0, "ingress (requests without an engine replica)", {})
    for number, replica in enumerate(sorted(replicas, key=lambda r: r.replica_id), start=1):
        pids[replica.replica_id] = number
        _process(events, number, f"engine replica {replica.replica_id}",
                 {"pid": replica.pid, "node_id": replica.node_id, "replica_id": replica.replica_id})
        _thread(events, number, STEPS_TID, "engine steps")
        for step in replica.steps:
            events.append(_step_span(number, step, since))
            events.append({"name": "batch", "ph": "C", "pid": number, "ts": _us(step.time, since),
                           "args": {"running": step.num_running, "waiting": step.num_waiting}})
            events.append({"name": "kv_usage", "ph": "C", "pid": number, "ts": _us(step.time, since),
                           "args": {"kv_usage": round(step.kv_usage, 4)}})
    lanes: dict[int, list[float]] = {}
    for timeline in sorted(timelines, key=lambda t: t.arrival_time):
        pid = pids.get(timeline.replica_id, 0)
        ends = lanes.setdefault(pid, [])
        num_lanes = len(ends)
        tid = _lane(ends, timeline.arrival_time, timeline.arrival_time + timeline.total_s)
        if len(ends) > num_lanes:
            _thread(events, pid, tid, f"requests {tid - FIRST_LANE_TID + 1}")
        events.extend(_request_spans(timeline, pid, tid, since))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"since": since, "until": until, "clock": "microseconds from `since` (time.time())",
                          "engine_replicas": len(replicas), "requests": len(timelines)}}


def _us(t: float, since: float) -> float:
    return round((t - since) * 1e6, 3)


def _process(events: list, pid: int, name: str, args: dict) -> None:
    events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name, **args}})
    events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})


def _thread(events: list, pid: int, tid: int, name: str) -> None:
    events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
    events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})


def _step_span(pid: int, step, since: float) -> dict[str, Any]:
    kind = "prefill+decode" if step.num_prefill_tokens and step.num_decode_tokens else (
        "prefill" if step.num_prefill_tokens else "decode")
    return {"name": f"step ({kind})", "cat": "step", "ph": "X", "pid": pid, "tid": STEPS_TID,
            "ts": _us(step.time, since), "dur": round(step.duration_s * 1e6, 3),
            "args": {"step": step.step, "prefill_tokens": step.num_prefill_tokens,
                     "prefill_requests": step.num_prefill_requests, "decode_sequences": step.num_decode_requests,
                     "preempted": step.num_preempted, "kv_usage": round(step.kv_usage, 4),
                     "running": step.num_running, "waiting": step.num_waiting, "finished": step.num_finished,
                     "prefix_cache_hits": step.prefix_cache_hits, "prefix_cache_queries": step.prefix_cache_queries,
                     "threads": step.num_threads,
                     # where the step's time went (ms): the rest of `dur` is output handling
                     **{f"{phase}_ms": round(getattr(step, f"{phase}_s") * 1e3, 3) for phase in STEP_PHASES}}}


def _lane(ends: list[float], start: float, end: float) -> int:
    """The first lane free at `start` (requests on one lane never overlap, so their spans nest properly)."""
    for i, last_end in enumerate(ends):
        if last_end <= start:
            ends[i] = end
            return FIRST_LANE_TID + i
    ends.append(end)
    return FIRST_LANE_TID + len(ends) - 1


def _request_spans(timeline: TimelineView, pid: int, tid: int, since: float) -> list[dict[str, Any]]:
    start = timeline.arrival_time
    summary = {"request_id": timeline.request_id, "replica_id": timeline.replica_id,
               "cached_tokens": timeline.cached_tokens, "expected_cached_tokens": timeline.expected_cached_tokens,
               "decode_steps": timeline.decode_steps, "preemptions": timeline.preemptions,
               "finish_reason": timeline.finish_reason, "total_s": timeline.total_s}
    out = [{"name": timeline.request_id, "cat": "request", "ph": "X", "pid": pid, "tid": tid,
            "ts": _us(start, since), "dur": round(timeline.total_s * 1e6, 3), "args": summary}]
    for stage in timeline.stages:
        out.append({"name": stage.stage, "cat": "stage", "ph": "X", "pid": pid, "tid": tid,
                    "ts": _us(start + stage.start_s, since), "dur": round(stage.duration_s * 1e6, 3),
                    "args": {"request_id": timeline.request_id}})
    for event in timeline.events:
        if event.event in INSTANT_EVENTS:
            args = {"request_id": timeline.request_id}
            if event.tokens is not None:
                args["tokens"] = event.tokens
            out.append({"name": event.event, "cat": "event", "ph": "i", "s": "t", "pid": pid, "tid": tid,
                        "ts": _us(start + event.t_s, since), "args": args})
    return out
