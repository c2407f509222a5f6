"""An asyncio HTTP client (aiohttp) that sends one request and records what arrives, chunk by chunk."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import aiohttp

from loadtests.openai_api import EndpointConfig, StreamRecorder, error_message, parse_full_response
from loadtests.records import ErrorDetails, RequestRecord, RequestSpec


def never_started(spec: RequestSpec, phase: str, scheduled_offset_s: float | None = None) -> RequestRecord:
    """The record of a request cancelled before its first byte was sent."""
    now_ns, now_perf = time.time_ns(), time.perf_counter_ns()
    return RequestRecord(uuid.uuid4().hex, spec.index, phase, spec.input_tokens, spec.max_tokens, now_ns, now_perf,
                         end_perf_ns=now_perf, cancelled=True, scheduled_offset_s=scheduled_offset_s,
                         error=ErrorDetails(499, "RequestCancellationError", "request was cancelled before it was sent"))


class StreamingClient:
    """One connection pool for a whole run. `send` never raises: every failure becomes the record's error."""

    def __init__(self, endpoint: EndpointConfig, request_timeout_s: float = 600.0, max_connections: int = 0) -> None:
        self.endpoint = endpoint
        self.request_timeout_s = request_timeout_s
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "StreamingClient":
        connector = aiohttp.TCPConnector(limit=self.max_connections, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(
            total=self.request_timeout_s, sock_connect=30))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(self, spec: RequestSpec, phase: str = "profiling",
                   scheduled_offset_s: float | None = None) -> RequestRecord:
        assert self._session is not None, "use `async with StreamingClient(...)`"
        request_id = uuid.uuid4().hex
        body = json.dumps(self.endpoint.body(spec.prompt, spec.max_tokens)).encode()
        record = RequestRecord(request_id, spec.index, phase, spec.input_tokens, spec.max_tokens, time.time_ns(),
                               time.perf_counter_ns(), scheduled_offset_s=scheduled_offset_s,
                               streamed=self.endpoint.streaming)
        try:
            async with self._session.post(self.endpoint.url, data=body,
                                          headers=self.endpoint.headers(request_id)) as resp:
                record.ack_perf_ns = time.perf_counter_ns()
                if resp.status != 200:
                    record.error = ErrorDetails(resp.status, "HTTPError", error_message(resp.status, await resp.read()))
                elif self.endpoint.streaming:
                    await self._read_stream(resp, record)
                else:
                    await self._read_full(resp, record)
        except asyncio.CancelledError:
            record.cancelled = True
            record.error = ErrorDetails(499, "RequestCancellationError", "request was still running when the run "
                                        "ended (past --duration and --grace-period)")
        except asyncio.TimeoutError:
            record.error = ErrorDetails(0, "TimeoutError", f"no complete response within {self.request_timeout_s:g} s")
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            record.error = ErrorDetails(0, type(exc).__name__, str(exc) or repr(exc))
        if record.end_perf_ns is None:
            record.end_perf_ns = time.perf_counter_ns()
        return record

    @staticmethod
    async def _read_stream(resp: aiohttp.ClientResponse, record: RequestRecord) -> None:
        recorder = StreamRecorder(record)
        try:
            async for line in resp.content:
                if recorder.feed(line):
                    break
        finally:
            record.end_perf_ns = time.perf_counter_ns()
            recorder.close()

    @staticmethod
    async def _read_full(resp: aiohttp.ClientResponse, record: RequestRecord) -> None:
        event = parse_full_response(json.loads(await resp.read()))
        now = time.perf_counter_ns()
        record.end_perf_ns = now
        record.output_text, record.finish_reason, record.usage = event.content, event.finish_reason, event.usage
        if event.content:
            record.chunk_perf_ns.append(now)
            record.chunk_chars.append(len(event.content))
