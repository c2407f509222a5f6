"""Joining the ingress's marks with an engine replica's events, and the Chrome trace built from both (no Ray)."""
from __future__ import annotations

import json

import pytest

from deployments.chrome_trace import chrome_trace
from deployments.records import EngineTimeline, ReplicaSteps
from deployments.timeline import RequestTimeline, RoutingNote
from engine.outputs import SchedulerStats
from engine.request import EventKind, RequestStatus

ENGINE_STAGES = ["to_engine", "admit", "queue", "prefill", "decode", "emit", "from_engine"]


def request_timeline(engine_events, first_chunk_s=0.060, end_s=0.500, routed=True, read_gap=0.004,
                     first_gap=0.004) -> RequestTimeline:
    """Ingress marks on a made-up clock from 100.0 s: tokenized +5 ms, sent +6 ms, routed +7 ms, then the engine."""
    t = RequestTimeline(wanted=True)
    t.arrived = 100.0
    t.tokenized, t.sent = 100.005, 100.006
    t.request_id = "cmpl-1"
    base = 100.006
    if routed:
        t.routing = RoutingNote("replica-a", 32, 100.007)
        base = 100.007
    t.first_chunk = base + first_chunk_s + first_gap
    t.last_chunk = t.engine_read = base + end_s + read_gap
    t.engine = EngineTimeline("replica-a", engine_events, first_chunk_s, end_s, num_decode_steps=9,
                              num_preemptions=sum(1 for e in engine_events if e[1] == EventKind.PREEMPTED),
                              num_cached_tokens=16)
    t.responded = t.last_chunk + 0.001
    t.last_byte = t.responded + 0.0005
    return t


PLAIN = [(0.001, EventKind.ENQUEUED, 0), (0.002, EventKind.SCHEDULED, 0), (0.050, EventKind.PREFILL_CHUNK, 300),
         (0.050, EventKind.FIRST_TOKEN, 0), (0.499, EventKind.FINISHED, int(RequestStatus.FINISHED_LENGTH))]


def test_stages_are_consecutive_in_order_and_add_up_to_the_ingress_total():
    view = request_timeline(PLAIN).view()
    assert [s.stage for s in view.stages] == ["tokenize", "dispatch", "route", *ENGINE_STAGES, "respond", "send"]
    for before, after in zip(view.stages, view.stages[1:]):
        assert after.start_s == pytest.approx(before.start_s + before.duration_s)
    assert sum(s.duration_s for s in view.stages) == pytest.approx(view.total_s)
    assert view.total_s == pytest.approx(0.007 + 0.500 + 0.004 + 0.0015)
    durations = {s.stage: s.duration_s for s in view.stages}
    # 4 ms of the ingress's wait is not the replica's own time: half of it goes out, the rest comes back.
    assert durations["to_engine"] == pytest.approx(0.002, abs=1e-9)
    assert durations["from_engine"] == pytest.approx(0.002, abs=1e-9)
    assert durations["queue"] == pytest.approx(0.001, abs=1e-9)
    assert durations["prefill"] == pytest.approx(0.048, abs=1e-9)
    assert durations["decode"] == pytest.approx(0.449, abs=1e-9)
    assert durations["emit"] == pytest.approx(0.001, abs=1e-9)
    assert view.finish_reason == "length" and view.cached_tokens == 16 and view.expected_cached_tokens == 32
    assert view.complete and view.last_byte and view.replica_id == view.routed_replica_id == "replica-a"


def test_events_keep_their_causal_order_on_the_ingress_clock():
    # The first chunk came back fast and the last slowly: to_engine stays below the first chunk's round trip.
    view = request_timeline(PLAIN, first_gap=0.0001, read_gap=0.030).view()
    names = [e.event for e in view.events]
    assert names == ["arrived", "tokenized", "sent", "routed", "received", "enqueued", "scheduled", "prefill_chunk",
                     "first_token", "first_chunk", "finished", "final_chunk_out", "last_chunk", "responded",
                     "last_byte"]
    times = [e.t_s for e in view.events]
    assert times == sorted(times)
    assert next(e for e in view.events if e.event == "prefill_chunk").tokens == 300


def test_a_preemption_splits_decode_and_shows_as_its_own_stage():
    events = PLAIN[:4] + [(0.200, EventKind.PREEMPTED, 0), (0.300, EventKind.RESUMED, 0),
                          (0.320, EventKind.PREFILL_CHUNK, 360), PLAIN[4]]
    view = request_timeline(events).view()
    assert [s.stage for s in view.stages] == ["tokenize", "dispatch", "route", "to_engine", "admit", "queue",
                                              "prefill", "decode", "preempted", "decode", "emit", "from_engine",
                                              "respond", "send"]
    assert {s.stage: s.duration_s for s in view.stages}["preempted"] == pytest.approx(0.100, abs=1e-9)
    assert view.preemptions == 1
    assert sum(s.duration_s for s in view.stages) == pytest.approx(view.total_s)


def test_a_stream_cut_short_at_the_ingress_has_one_engine_stage():
    t = request_timeline(PLAIN, routed=False)
    t.engine = t.engine_read = None
    view = t.view()
    assert [s.stage for s in view.stages] == ["tokenize", "dispatch", "engine", "respond", "send"]
    assert not view.complete and sum(s.duration_s for s in view.stages) == pytest.approx(view.total_s)


def step(number: int, at: float, prefill: int, decodes: int) -> SchedulerStats:
    return SchedulerStats(step=number, time=at, duration_s=0.03, num_running=decodes + (prefill > 0),
                          num_waiting=0, kv_usage=0.25, num_prefill_tokens=prefill, num_decode_tokens=decodes,
                          num_prefill_requests=int(prefill > 0), num_decode_requests=decodes, num_preempted=0,
                          prefix_cache_queries=prefill, prefix_cache_hits=0, num_finished=0, schedule_s=0.001,
                          prepare_s=0.002, forward_s=0.02, sample_s=0.005)


def test_chrome_trace_has_a_process_per_replica_and_a_span_per_stage():
    replicas = [ReplicaSteps("replica-a", 11, "node", 2000.0, [step(1, 1000.01, 300, 0), step(2, 1000.05, 0, 2)]),
                ReplicaSteps("replica-b", 12, "node", 2000.0, [step(1, 1000.02, 0, 1)])]
    views = []
    for arrival in (1000.0, 1000.1, 1000.7):  # the first two overlap: two lanes
        t = request_timeline(PLAIN)
        t.arrival_time = arrival
        views.append(t.view())
    trace = json.loads(json.dumps(chrome_trace(replicas, views, since=999.0, until=1002.0)))
    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(n for n in processes.values() if n.startswith("engine replica")) == \
        ["engine replica replica-a", "engine replica replica-b"]
    for e in events:
        assert e["ph"] in ("M", "X", "C", "i") and isinstance(e["pid"], int)
        if e["ph"] in ("X", "i", "C"):
            assert e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["tid"], int)
    steps = [e for e in events if e.get("cat") == "step"]
    assert len(steps) == 3 and steps[0]["args"]["prefill_tokens"] == 300
    assert [steps[0]["args"][f"{phase}_ms"] for phase in ("schedule", "prepare", "forward", "sample")] == [1, 2, 20, 5]
    stage_spans = [e for e in events if e.get("cat") == "stage"]
    assert len(stage_spans) == sum(len(v.stages) for v in views)
    requests = [e for e in events if e.get("cat") == "request"]
    assert len(requests) == 3 and len({(e["pid"], e["tid"]) for e in requests}) == 2
    for lane in {(e["pid"], e["tid"]) for e in requests}:  # spans on one lane never overlap
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in requests if (e["pid"], e["tid"]) == lane)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_the_off_switch_reaches_the_engine_and_the_ingress():
    from deployments.config import AppArgs
    from deployments.errors import OpenAIError
    from deployments.timeline_config import TimelineArgs
    from deployments.timeline_recorder import TimelineRecorder

    on = AppArgs(model="/models/x.gguf").engine_config()
    off = AppArgs(model="/models/x.gguf", timeline={"enabled": False}).engine_config()
    assert on.record_request_events and on.step_history == TimelineArgs().step_ring
    assert not off.record_request_events and off.step_history == 512  # the metrics still read the ring
    recorder = TimelineRecorder(TimelineArgs(enabled=False), "model")
    with pytest.raises(OpenAIError) as refused:
        recorder.lookup("cmpl-1")
    assert refused.value.status == 404 and refused.value.body.error.code == "timelines_disabled"


def test_the_store_keeps_the_most_recent_timelines():
    from deployments.timeline_recorder import TimelineStore

    store = TimelineStore(capacity=2)
    for i in range(3):
        t = request_timeline(PLAIN)
        t.request_id = f"cmpl-{i}"
        store.put(t)
    assert store.get("cmpl-0") is None and store.get("cmpl-2").request_id == "cmpl-2"
    assert [t.request_id for t in store.since(0.0)] == ["cmpl-1", "cmpl-2"]
