"""Ray's Prometheus export carries the engine and HTTP metrics, parsed with prometheus_client's own parser."""
from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.slow, pytest.mark.serve]


def samples(text: str, name: str) -> list:
    """Every sample of the metric family `name` (as exported by Ray, prefixed `ray_`)."""
    return [s for family in text_string_to_metric_families(text) if family.name == name for s in family.samples]


def total(text: str, sample_name: str) -> float:
    return sum(s.value for s in samples(text, sample_name.removesuffix("_count").removesuffix("_total"))
               if s.name == sample_name)


TTFT_COUNT = "ray_tokenline_time_to_first_token_seconds_count"


def settled_total(serve_app, sample_name: str, timeout_s: float = 30.0) -> float:
    """The value once it has stopped moving for over two report periods (1 s each in the fixture)."""
    deadline = time.monotonic() + timeout_s
    last = total(serve_app.scrape_metrics(), sample_name)
    while time.monotonic() < deadline:
        time.sleep(2.5)
        now = total(serve_app.scrape_metrics(), sample_name)
        if now == last:
            return now
        last = now
    raise AssertionError(f"{sample_name} kept changing for {timeout_s:.0f}s")


def test_ttft_histogram_counts_every_request_served(serve_app):
    before = settled_total(serve_app, TTFT_COUNT)
    served = 0
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as http:
        for i in range(4):
            r = http.post("/v1/completions", json={"model": serve_app.model, "prompt": f"Number {i} is",
                                                   "max_tokens": 3, "n": 1 + i % 2})
            assert r.status_code == 200
            served += len(r.json()["choices"])  # each choice is one engine request
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}).status_code == 400
    assert settled_total(serve_app, TTFT_COUNT) - before == served == 6


def test_engine_gauges_exist_per_replica(serve_app):
    replicas = {s.replica_id for s in serve_app.engine_replica_stats()}
    deadline = time.monotonic() + 20
    while True:
        text = serve_app.scrape_metrics()
        found = {name: {s.labels.get("replica") for s in samples(text, name)}
                 for name in ("ray_tokenline_kv_cache_usage_perc", "ray_tokenline_num_requests_waiting",
                              "ray_tokenline_num_requests_waiting_late", "ray_tokenline_num_requests_running",
                              "ray_tokenline_engine_info")}
        if all(labels == replicas for labels in found.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(replicas) == 2
    assert all(labels == replicas for labels in found.values()), found
    assert all(0.0 <= s.value <= 1.0 for s in samples(text, "ray_tokenline_kv_cache_usage_perc"))
    # How each engine runs: on this CPU machine the native CPU kernels (plain torch without a compiler), no graphs.
    for info in samples(text, "ray_tokenline_engine_info"):
        assert info.value == 1 and info.labels["device"] == "cpu" and info.labels["cuda_graphs"] == "false"
        assert info.labels["attention_backend"] in ("cpu", "torch") and info.labels["dtype"] == "bfloat16"


def test_vllm_metric_set_and_http_metrics_are_exported(serve_app):
    prompt = " ".join(f"line {i}" for i in range(40))
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as http:
        for _ in range(3):  # two replicas: the third repeat at the latest hits a warm prefix cache
            assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}],
                                                           "max_tokens": 5, "ignore_eos": True}).status_code == 200
    # Counters appear with their first increment, so preemptions (none happen here) are not expected.
    expected = ["prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens", "request_success",
                "iteration_tokens_total", "request_prompt_tokens", "request_generation_tokens",
                "request_params_n", "request_params_max_tokens", "inter_token_latency_seconds",
                "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
                "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                "request_inference_time_seconds", "http_requests", "http_request_duration_seconds",
                "http_time_to_first_byte_seconds", "http_requests_in_progress"]
    deadline = time.monotonic() + 20
    while True:
        families = {f.name for f in text_string_to_metric_families(serve_app.scrape_metrics())}
        missing = [name for name in expected if f"ray_tokenline_{name}" not in families]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not missing
    text = serve_app.scrape_metrics()
    ok = [s for s in samples(text, "ray_tokenline_http_requests")
          if s.labels.get("route") == "/v1/chat/completions" and s.labels.get("status") == "200"]
    assert ok and sum(s.value for s in ok) >= 1
    reasons = {s.labels.get("finished_reason") for s in samples(text, "ray_tokenline_request_success")}
    assert "length" in reasons


def test_streamed_chunks_travel_over_the_token_channel(serve_app):
    """One message per engine step per replica: a stream's chunks, the first included, come over the channel."""
    messages = "ray_tokenline_token_channel_messages_total"
    chunks = "ray_tokenline_token_channel_chunks_total"
    before = {name: settled_total(serve_app, name) for name in (messages, chunks)}
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={"model": serve_app.model, "prompt": "Count: 1, 2,",
                                                          "max_tokens": 8, "ignore_eos": True, "stream": True,
                                                          "temperature": 0}) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    carried = settled_total(serve_app, chunks) - before[chunks]
    assert 1 <= carried <= 8  # 8 tokens (merged or not), none through Serve
    assert 1 <= settled_total(serve_app, messages) - before[messages] <= carried
    before = settled_total(serve_app, chunks)
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as http:  # one token: its one chunk is the first
        with http.stream("POST", "/v1/completions", json={"model": serve_app.model, "prompt": "Count: 1, 2,",
                                                          "max_tokens": 1, "stream": True}) as r:
            assert r.status_code == 200 and sum(1 for line in r.iter_lines() if line.startswith("data: {")) == 1
    assert settled_total(serve_app, chunks) - before == 1
