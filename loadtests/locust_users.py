"""Locust users that stream chat or completions and report TTFT, ITL, output tokens and tokens/s per user.

Each request is reported once as itself (its response time is the whole stream, not just the headers) and its
measurements as custom entries of type METRIC (`events.request.fire`): time_to_first_token and
inter_token_latency in ms, output_tokens and output_token_throughput_per_user as plain numbers in the
response-time column. Locust rounds those to two significant digits, so `--records-jsonl` keeps exact ones.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

import requests
from locust import HttpUser, constant, events, task

from loadtests.locust_setup import STATE
from loadtests.metrics import output_token_count, record_metrics
from loadtests.openai_api import ENDPOINT_PATHS, Endpoint, EndpointConfig, StreamRecorder, error_message
from loadtests.records import ErrorDetails, RequestRecord, RequestSpec


def fire_metric(name: str, value: float | None) -> None:
    if value is not None:
        events.request.fire(request_type="METRIC", name=name, response_time=value, response_length=0,
                            exception=None, context={})


class _OpenAIUser(HttpUser):
    abstract = True
    endpoint: Endpoint = "chat"
    wait_time = constant(0)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        model = options.model or self._first_model()
        self.config = EndpointConfig(self.host, model, self.endpoint, options.api_key or None, True,
                                     options.ignore_eos)
        self.path = ENDPOINT_PATHS[self.endpoint]

    def _first_model(self) -> str:
        resp = self.client.get("/v1/models", name="/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]

    @task
    def generate(self) -> None:
        assert STATE.source is not None, "the prompt source is built at Locust's init event"
        spec = STATE.source.next()
        record = self._stream(spec)
        metrics = record_metrics(record, output_token_count(record, STATE.source.builder.count)) if record.ok \
            else None
        if metrics is not None:
            fire_metric("time_to_first_token", metrics.time_to_first_token)
            fire_metric("inter_token_latency", metrics.inter_token_latency)
            fire_metric("output_tokens", metrics.output_sequence_length)
            fire_metric("output_token_throughput_per_user", metrics.output_token_throughput_per_user)
        STATE.write(record, metrics)

    def _stream(self, spec: RequestSpec) -> RequestRecord:
        request_id = uuid.uuid4().hex
        body = json.dumps(self.config.body(spec.prompt, spec.max_tokens))
        record = RequestRecord(request_id, spec.index, "profiling", spec.input_tokens, spec.max_tokens,
                               time.time_ns(), time.perf_counter_ns())
        received = 0
        with self.client.post(self.path, data=body, headers=self.config.headers(request_id), stream=True,
                              catch_response=True, name=self.path) as resp:
            record.ack_perf_ns = time.perf_counter_ns()
            try:
                if resp.status_code == 0:  # no response at all: Locust keeps the exception on the response
                    err = getattr(resp, "error", None)
                    record.error = ErrorDetails(0, type(err).__name__ if err else "ConnectionError", str(err))
                elif resp.status_code != 200:
                    record.error = ErrorDetails(resp.status_code, "HTTPError",
                                                error_message(resp.status_code, resp.content or b""))
                else:
                    received = self._read(resp, record)
            except (requests.RequestException, ValueError) as exc:
                record.error = ErrorDetails(0, type(exc).__name__, str(exc))
            record.end_perf_ns = time.perf_counter_ns()
            resp.request_meta["response_time"] = (record.end_perf_ns - record.start_perf_ns) / 1e6
            resp.request_meta["response_length"] = received
            if record.error is None:
                resp.success()
            else:
                resp.failure(f"{record.error.type}: {record.error.message}")
        return record

    @staticmethod
    def _read(resp: Any, record: RequestRecord) -> int:
        recorder = StreamRecorder(record)
        received = 0
        for line in resp.iter_lines(chunk_size=None):  # whole HTTP chunks as they arrive: exact chunk times
            received += len(line)
            if recorder.feed(line):
                break
        recorder.close()
        return received


class ChatUser(_OpenAIUser):
    """Streams /v1/chat/completions."""

    endpoint: Endpoint = "chat"


class CompletionsUser(_OpenAIUser):
    """Streams /v1/completions."""

    endpoint: Endpoint = "completions"
