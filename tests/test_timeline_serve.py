"""Request timelines, the step trace, the profiler and the dashboards, against the real app (the session's one)."""
from __future__ import annotations

import asyncio
import json
import random
import re
import time
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.serve]

ASK = {"X-Tokenline-Timeline": "1"}
STAGES = ["tokenize", "dispatch", "route", "to_engine", "admit", "queue", "prefill", "decode", "emit", "from_engine",
          "respond"]
EVENTS = ["arrived", "tokenized", "sent", "routed", "received", "enqueued", "scheduled", "first_token",
          "first_chunk", "finished", "final_chunk_out", "last_chunk", "responded"]


def assert_well_formed(timeline: dict, stored: bool) -> None:
    """Every stage, in order and back to back; every event in its causal order on the ingress clock."""
    assert [s["stage"] for s in timeline["stages"]] == STAGES + (["send"] if stored else [])
    for before, after in zip(timeline["stages"], timeline["stages"][1:]):
        assert after["start_s"] == pytest.approx(before["start_s"] + before["duration_s"], abs=1e-6)
    assert all(s["duration_s"] >= 0 for s in timeline["stages"])
    assert sum(s["duration_s"] for s in timeline["stages"]) == pytest.approx(timeline["total_s"], abs=1e-6)
    events = [e for e in timeline["events"] if e["event"] in EVENTS]
    assert [e["event"] for e in events] == EVENTS
    assert [e["t_s"] for e in timeline["events"]] == sorted(e["t_s"] for e in timeline["events"])
    assert any(e["event"] == "prefill_chunk" and e["tokens"] > 0 for e in timeline["events"])
    routed = next(e for e in timeline["events"] if e["event"] == "routed")
    assert routed["replica_id"] and routed["expected_cached_tokens"] >= 0
    assert timeline["complete"] and timeline["replica_id"] and timeline["finish_reason"] == "length"


def assert_adds_up_to(timeline: dict, client_s: float) -> None:
    """What the timeline leaves out is Serve's HTTP proxy and the client's own reading: a few ms, which 48 output
    tokens (a second or two here) keep a small share of the whole."""
    total = sum(s["duration_s"] for s in timeline["stages"])
    assert total <= client_s
    assert client_s - total <= max(0.05 * client_s, 0.005), (client_s, timeline["stages"])


def read_sse_timeline(lines: list[str]) -> dict:
    """The chunk before [DONE] carrying `timeline`; every other chunk is an ordinary one."""
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1] if line.startswith("data: ")]
    carrying = [c for c in chunks if "timeline" in c]
    assert len(carrying) == 1 and carrying[0] is chunks[-1] and carrying[0]["choices"] == []
    return carrying[0]


def test_non_streamed_timeline_has_every_stage_and_adds_up_to_the_client_latency(serve_app):
    body = {"model": serve_app.model, "prompt": "The rivers of Europe include", "max_tokens": 48,
            "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=serve_app.base_url, timeout=120) as http:
        http.post("/v1/completions", json={**body, "max_tokens": 2})  # connection and caches warm
        start = time.perf_counter()
        response = http.post("/v1/completions", json=body, headers=ASK)
        client_s = time.perf_counter() - start
        assert response.status_code == 200
        reply = response.json()
        assert_well_formed(reply["timeline"], stored=False)
        assert_adds_up_to(reply["timeline"], client_s)
        assert reply["timeline"]["decode_steps"] == 47  # the first token comes from the prefill step
        stored = http.get(f"/v1/timelines/{reply['id']}").json()
        assert_well_formed(stored, stored=True)
        assert stored["stages"][:-1] == reply["timeline"]["stages"]  # and `send`, once the last byte went
        plain = http.post("/v1/completions", json=body)  # not asked for: no timeline in the body
        assert "timeline" not in plain.json()


def test_streamed_chat_timeline_arrives_before_done_and_adds_up_to_the_client_latency(serve_app):
    body = {"model": serve_app.model, "messages": [{"role": "user", "content": "Count to twenty."}],
            "max_tokens": 48, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=serve_app.base_url, timeout=120) as http:
        http.post("/v1/chat/completions", json={**body, "max_tokens": 2, "stream": False,
                                                "stream_options": None})
        start = time.perf_counter()
        with http.stream("POST", "/v1/chat/completions", json=body, headers=ASK) as response:
            lines = [line for line in response.iter_lines() if line]
        client_s = time.perf_counter() - start
        last = read_sse_timeline(lines)
        assert_well_formed(last["timeline"], stored=False)
        assert_adds_up_to(last["timeline"], client_s)
        stored = http.get(f"/v1/timelines/{last['id']}")
        assert stored.status_code == 200
        assert_well_formed(stored.json(), stored=True)


def test_the_official_openai_client_keeps_the_timeline_as_an_extra_field(serve_app):
    from openai import OpenAI

    client = OpenAI(base_url=f"{serve_app.base_url}/v1", api_key="unused", default_headers=ASK)
    reply = client.chat.completions.create(model=serve_app.model, max_tokens=8, extra_body={"ignore_eos": True},
                                           messages=[{"role": "user", "content": "Hi"}])
    assert reply.choices[0].message.content and reply.model_extra["timeline"]["stages"]
    chunks = list(client.completions.create(model=serve_app.model, prompt="Once upon a time", max_tokens=8,
                                            stream=True, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text and chunks[-1].choices == [] and chunks[-1].model_extra["timeline"]["stages"]


def test_unknown_timeline_and_bad_trace_window_get_openai_errors(serve_app):
    with httpx.Client(base_url=serve_app.base_url, timeout=30) as http:
        missing = http.get("/v1/timelines/cmpl-does-not-exist")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "timeline_not_found"
        for seconds in ("0", "-1", "9999", "abc"):
            bad = http.get("/debug/trace", params={"seconds": seconds})
            assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}


async def burst(base_url: str, model: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        async def one(prompt: list[int]) -> dict:
            response = await http.post("/v1/completions", headers=ASK, json={
                "model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
            assert response.status_code == 200, response.text
            return response.json()
        return await asyncio.gather(*(one(p) for p in prompts))


def test_a_preempted_request_shows_its_preemption(serve_app):
    # Each replica has 384 blocks of 16 tokens. A 496-token prompt holds 31 blocks, so 12 prompts fill a pool and
    # then grow by a block each every 16 tokens: with 28 requests at once at least one replica holds 12 or more
    # and must preempt. Random prompts share no prefix.
    before = sum(s.num_preemptions for s in serve_app.engine_replica_stats())
    rng = random.Random(time.time_ns())
    prompts = [[rng.randrange(300, 40000) for _ in range(496)] for _ in range(28)]
    replies = asyncio.run(burst(serve_app.base_url, serve_app.model, prompts, max_tokens=48))
    assert sum(s.num_preemptions for s in serve_app.engine_replica_stats()) > before
    preempted = [r["timeline"] for r in replies if r["timeline"]["preemptions"]]
    assert preempted, "no timeline shows a preemption although the engines preempted"
    for timeline in preempted:
        stages = [s["stage"] for s in timeline["stages"]]
        events = [e["event"] for e in timeline["events"]]
        assert stages.count("preempted") == events.count("preempted") == events.count("resumed") \
            == timeline["preemptions"]
        assert stages[:7] == STAGES[:7] and stages[-3:] == ["emit", "from_engine", "respond"]
        assert set(stages[7:-3]) <= {"prefill", "preempted", "decode"}
        assert sum(s["duration_s"] for s in timeline["stages"]) == pytest.approx(timeline["total_s"], abs=1e-6)
    assert all(r["usage"]["completion_tokens"] == 48 for r in replies)


def test_stage_histograms_and_every_dashboard_metric_appear_in_a_scrape(serve_app):
    """After the preemption above, even the counters that appear on their first event are there."""
    from prometheus_client.parser import text_string_to_metric_families

    dashboard = json.loads((Path(__file__).parents[1] / "k8s/base/grafana-dashboard.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]
    queries += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    wanted = {name for q in queries for name in re.findall(r"\b(ray_[a-z0-9_]+)\b", q)}
    assert "ray_tokenline_request_stage_seconds_bucket" in wanted
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as http:
        assert http.post("/v1/completions", json={"model": serve_app.model, "prompt": "Hello",
                                                  "max_tokens": 2}).status_code == 200
    deadline, seen, stages = time.monotonic() + 60, set(), set()
    while time.monotonic() < deadline and not (wanted <= seen and {"tokenize", "route", "respond"} <= stages):
        text = serve_app.scrape_metrics()
        seen |= set(re.findall(r"^(ray_[a-z0-9_]+)", text, re.M))
        stages |= {s.labels.get("stage") for f in text_string_to_metric_families(text)
                   if f.name == "ray_tokenline_request_stage_seconds" for s in f.samples}
        time.sleep(1)
    assert wanted <= seen, f"dashboard metrics absent from the app's Prometheus export: {sorted(wanted - seen)}"
    assert {"tokenize", "dispatch", "route", "to_engine", "admit", "emit", "from_engine", "respond",
            "send"} <= stages
    assert not {"queue", "prefill", "decode"} & stages  # the engine's own histograms hold those


def test_chrome_trace_has_a_track_per_replica_and_a_span_per_request_stage(serve_app, tmp_path):
    with httpx.Client(base_url=serve_app.base_url, timeout=120) as http:
        ids = [http.post("/v1/completions", json={"model": serve_app.model, "prompt": f"Item {i}:", "max_tokens": 6,
                                                  "ignore_eos": True}).json()["id"] for i in range(4)]
        response = http.get("/debug/trace", params={"seconds": 30})
        assert response.status_code == 200
        trace = json.loads(response.content)
        timelines = {i: http.get(f"/v1/timelines/{i}").json() for i in ids}
    events = trace["traceEvents"]
    replicas = {s.replica_id for s in serve_app.engine_replica_stats()}
    processes = {e["pid"]: e["args"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    engine_pids = {pid for pid, a in processes.items() if a.get("replica_id")}
    assert {processes[pid]["replica_id"] for pid in engine_pids} == replicas and len(engine_pids) == 2
    steps = [e for e in events if e.get("cat") == "step"]
    assert {e["pid"] for e in steps} <= engine_pids and steps
    assert all(e["ph"] == "X" and e["dur"] >= 0 and e["ts"] >= 0 and "decode_sequences" in e["args"] for e in steps)
    for request_id, timeline in timelines.items():
        spans = [e for e in events if e.get("cat") == "stage" and e["args"]["request_id"] == request_id]
        assert [e["name"] for e in spans] == [s["stage"] for s in timeline["stages"]]
        assert len({(e["pid"], e["tid"]) for e in spans}) == 1
        assert processes[spans[0]["pid"]].get("replica_id") == timeline["replica_id"]

    from deployments import trace as trace_cli

    out, png = tmp_path / "trace.json", tmp_path / "timeline.png"
    assert trace_cli.main(["--url", serve_app.base_url, "--seconds", "30", "--out", str(out), "--png", str(png)]) == 0
    assert json.loads(out.read_text())["traceEvents"] and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profiling_writes_a_trace_file_per_engine_replica(serve_app):
    replicas = {s.replica_id for s in serve_app.engine_replica_stats()}
    with httpx.Client(base_url=serve_app.base_url, timeout=120) as http:
        started = http.post("/start_profile")
        assert started.status_code == 200 and started.json()["profiling"]
        assert http.post("/start_profile").status_code == 409  # already running everywhere
        # Requests inside the window, each awaited, until every replica has run one: routing alone may keep a
        # few on one replica, and a replica that ran no step writes a trace without a model operator.
        served: set[str] = set()
        for i in range(40):
            if served >= replicas:
                break
            reply = http.post("/v1/completions", headers={"X-Tokenline-Timeline": "1"},
                              json={"model": serve_app.model, "prompt": f"Profile {i}", "max_tokens": 4})
            assert reply.status_code == 200, reply.text
            served.add(reply.json()["timeline"]["replica_id"])
        assert served == replicas
        stopped = http.post("/stop_profile")
        assert stopped.status_code == 200
        reply = stopped.json()
        again = http.post("/stop_profile")
        assert again.status_code == 409 and again.json()["error"]["code"] == "profiler_not_running"
    assert {r["replica_id"] for r in reply["replicas"]} == replicas and not reply["profiling"]
    paths = [Path(r["path"]) for r in reply["replicas"]]
    assert len(set(paths)) == 2 and all(p.parent == Path(serve_app.args.profiler_dir) for p in paths)
    for path in paths:
        names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
        # The model's linear layers ran: as PyTorch's, oneDNN's or the engine's own packed kernels.
        assert {"aten::mm", "aten::linear", "aten::addmm"} & names or any(
            n and ("mkldnn" in n or n.startswith("tokenline::")) for n in names), sorted(filter(None, names))


def test_ray_dashboard_serve_api_lists_the_app_and_its_deployments(serve_app):
    details = serve_app.dashboard_json("/api/serve/applications/")
    app = details["applications"]["tokenline"]
    assert app["status"] == "RUNNING" and app["route_prefix"] == "/"
    deployments = app["deployments"]
    assert {"OpenAIIngress", "EngineReplica"} <= set(deployments)
    engine = deployments["EngineReplica"]
    assert engine["status"] == "HEALTHY" and len([r for r in engine["replicas"] if r["state"] == "RUNNING"]) == 2
