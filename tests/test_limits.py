"""The ingress's bounds on their own: header checks and the throughput meter behind deadline-aware admission."""
from __future__ import annotations

import pytest

from deployments.errors import OpenAIError
from deployments.limits import LimitsArgs, ThroughputMeter, _check_headers


def scope(**headers: str) -> dict:
    return {"type": "http", "method": "POST", "path": "/v1/completions",
            "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}


def test_meter_says_nothing_until_it_has_seen_a_whole_window():
    meter = ThroughputMeter(window_s=10, min_samples=4)
    for t in range(5):
        meter.record(100.0 + t)
    assert meter.rate(104.0) is None  # 4 s of history: too short to call a rate
    for t in range(5, 11):
        meter.record(100.0 + t)
    assert meter.rate(110.0) == pytest.approx(1.1)  # 11 answers in the last 10 s
    assert meter.rate(130.0) is None  # nothing answered lately: no rate, so no refusal on it


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
