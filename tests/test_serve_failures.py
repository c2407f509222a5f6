"""Failures and changes under load: a killed engine replica, an engine whose step loop dies, overload past every
bound, a redeploy that scales down while streams run, overload against deadlines, and /health with no engine
replica. A test that needs the session's app as it started asks for it (as_started); one that redeploys it leaves
it so."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections import Counter

import httpx
import psutil
import pytest

from deployments.config import AppArgs
from tests.serve_processes import (ENGINE, INGRESS, as_started, break_step_loop, replica_actors, replica_pids,
                                   rss_mb, wait_for_replicas, wait_until_idle)

pytestmark = [pytest.mark.slow, pytest.mark.serve, pytest.mark.disruptive]


async def one_request(http: httpx.AsyncClient, model: str, i: int, stream: bool, max_tokens: int) -> str:
    """How one request ended: complete, error-event (an SSE error, then [DONE]) or status-NNN."""
    body = {"model": model, "prompt": f"Request {i}: once upon a time", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}
    if not stream:
        response = await http.post("/v1/completions", json=body)
        if response.status_code != 200:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            return f"status-{response.status_code}"
        assert response.json()["usage"]["completion_tokens"] == max_tokens
        return "complete"
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            return f"status-{response.status_code}"
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    if lines[-2].startswith('data: {"error"'):
        assert set(json.loads(lines[-2][6:])["error"]) == {"message", "type", "param", "code"}
        return "error-event"
    finish = [c["finish_reason"] for line in lines[:-1] for c in json.loads(line[6:])["choices"]]
    assert finish[-1] == "length", finish[-3:]
    return "complete"


async def requests_at_once(base_url: str, model: str, count: int, max_tokens: int, stream: bool = True,
                           timeout_s: float = 180, headers: dict | None = None) -> list[str]:
    limits = httpx.Limits(max_connections=count + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits, headers=headers) as http:
        return await asyncio.wait_for(
            asyncio.gather(*(one_request(http, model, i, stream and i % 4 != 3, max_tokens) for i in range(count))),
            timeout=timeout_s)


class Background:
    """Runs requests_at_once on its own thread, so the test can break things while they are in flight."""

    def __init__(self, *args, **kwargs) -> None:
        self.outcomes: list[str] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=args, kwargs=kwargs, daemon=True)
        self._thread.start()

    def _run(self, *args, **kwargs) -> None:
        try:
            self.outcomes = asyncio.run(requests_at_once(*args, **kwargs))
        except BaseException as exc:
            self.error = exc

    def result(self, timeout_s: float) -> list[str]:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "requests still hang"
        if self.error is not None:
            raise self.error
        return self.outcomes


def wait_until_busy(serve_app, min_running: int, timeout_s: float = 60, since: dict | None = None) -> list:
    """Until the engine replicas run `min_running` requests between them. With `since` (each replica's
    generation tokens before the load), also until every replica has made two tokens per request it runs: its
    streams have had their first token, so a request cut now fails rather than being retried elsewhere."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = serve_app.engine_replica_stats()
        decoding = since is None or all(s.num_generation_tokens - since.get(s.replica_id, 0) >= 2 * s.num_running
                                        for s in stats)
        if sum(s.num_running for s in stats) >= min_running and decoding:
            return stats
        time.sleep(0.1)
    raise TimeoutError("the engine replicas never got busy")


def sequential_requests_succeed(serve_app, count: int) -> list[int]:
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as http:
        return [http.post("/v1/completions", json={"prompt": f"Hi {i}", "max_tokens": 2}).status_code
                for i in range(count)]


def test_killed_engine_replica_fails_its_requests_cleanly_and_is_replaced(serve_app):
    as_started(serve_app)
    assert len(wait_until_idle(serve_app, 60)) == 2
    pids = replica_pids(ENGINE)
    assert len(pids) == 2
    made = {s.replica_id: s.num_generation_tokens for s in serve_app.engine_replica_stats()}
    load = Background(serve_app.base_url, serve_app.model, 16, 400)
    stats = wait_until_busy(serve_app, 8, since=made)
    victim = max(stats, key=lambda s: s.num_running).replica_id
    os.kill(pids[victim], signal.SIGKILL)
    # Straight after the kill, new requests go to the live replica: none waits on or fails for the dead one.
    assert sequential_requests_succeed(serve_app, 6) == [200] * 6
    outcomes = load.result(180)
    # The victim's requests end with an SSE error event (streams) or a 503 (whole responses), never a hang;
    # the survivor's complete.
    assert set(outcomes) <= {"complete", "error-event", "status-503"}, outcomes
    assert outcomes.count("complete") >= 1 and len(outcomes) - outcomes.count("complete") >= 1, outcomes
    wait_for_replicas(serve_app, 2, 240, without={victim})
    assert sequential_requests_succeed(serve_app, 4) == [200] * 4
    assert len(wait_until_idle(serve_app, 60)) == 2


def process_is_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_replica_whose_engine_dies_exits_at_once_and_is_replaced(serve_app):
    import ray

    as_started(serve_app)
    assert len(wait_until_idle(serve_app, 60)) == 2
    pids = replica_pids(ENGINE)
    victim_id, victim = sorted(replica_actors(ENGINE).items())[0]
    ray.get(victim.__ray_call__.remote(break_step_loop), timeout=30)
    # Its engine's state is unknown: the process exits within a second or two, instead of staying routable
    # until Serve's health check has failed three periods in a row.
    deadline = time.monotonic() + 10
    while not process_is_gone(pids[victim_id]):
        assert time.monotonic() < deadline, "the replica whose engine died is still running"
        time.sleep(0.2)
    # Requests sent meanwhile are served: one whose replica is lost before its first token is retried elsewhere.
    assert sequential_requests_succeed(serve_app, 6) == [200] * 6
    wait_for_replicas(serve_app, 2, 240, without={victim_id})
    assert sequential_requests_succeed(serve_app, 4) == [200] * 4


def overloaded_args(args: AppArgs) -> AppArgs:
    """One engine replica with tiny bounds everywhere, and a 6 s default deadline."""
    engine = args.engine.model_copy(update={"max_num_seqs": 2, "max_num_waiting": 1})
    limits = args.limits.model_copy(update={"max_concurrent_requests": 10, "engine_max_queued_requests": 2,
                                            "request_timeout_s": 6.0, "graceful_shutdown_timeout_s": 30.0})
    return args.model_copy(update={"num_engine_replicas": 1, "engine_max_ongoing_requests": 4, "engine": engine,
                                   "max_num_seqs": None, "limits": limits})


def test_redeploy_drains_streams_then_overload_is_refused_with_retry_after(serve_app):
    as_started(serve_app)
    assert len(wait_until_idle(serve_app, 60)) == 2
    # Scale down and change every replica's arguments while 12 requests stream: none is cut.
    load = Background(serve_app.base_url, serve_app.model, 12, 48)
    wait_until_busy(serve_app, 6)
    serve_app.redeploy(overloaded_args(serve_app.started_args))
    assert load.result(240) == ["complete"] * 12
    assert len(wait_for_replicas(serve_app, 1, 120)) == 1

    ingress_pids = replica_pids(INGRESS)
    before = rss_mb(ingress_pids)
    outcomes: list[tuple[int, str, str | None]] = []
    for _ in range(2):
        outcomes += asyncio.run(flood(serve_app.base_url, 40))
    after = rss_mb(ingress_pids)
    codes = {code for code, _, _ in outcomes}
    assert codes == {200, 503}, outcomes
    refusals = [message for code, message, _ in outcomes if code == 503]
    assert all(retry_after and int(retry_after) >= 1 for code, _, retry_after in outcomes if code == 503)
    assert any("requests at once" in m for m in refusals), refusals  # the ingress's own bound
    assert any("waiting queue is full" in m or "every engine replica is busy" in m for m in refusals), refusals
    assert all(after[r] - before[r] < 32 for r in before), (before, after)

    # The configured deadline (6 s here) ends a request nobody set a deadline for.
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as http:
        response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3000, "ignore_eos": True})
    assert response.status_code == 408 and response.json()["error"]["code"] == "request_timeout"
    stats = wait_until_idle(serve_app, 30, num_replicas=1)
    assert all(s.num_running == 0 and s.num_used_kv_blocks == 0 for s in stats), stats


async def flood(base_url: str, count: int) -> list[tuple[int, str, str | None]]:
    """`count` requests at once; each answer as (status, error message or '', Retry-After)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120,
                                 limits=httpx.Limits(max_connections=count + 4)) as http:
        async def one(i: int) -> tuple[int, str, str | None]:
            response = await http.post("/v1/completions", json={"prompt": f"Flood {i}", "max_tokens": 24,
                                                                 "ignore_eos": True})
            if response.status_code == 200:
                return 200, "", None
            assert response.headers.get("content-type") == "application/json", (response.status_code, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            return response.status_code, error["message"], response.headers.get("retry-after")

        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(count))), timeout=180)


DEADLINE_S = 20.0  # every request of the overload test carries this deadline (X-Request-Timeout)
LOAD_S = 45.0
OVERLOAD = 3.0  # the closed loop's clients, in units of what the replica can serve within one deadline


def deadline_args(args: AppArgs) -> AppArgs:
    """One engine replica running 4 sequences at most: a capacity a few dozen clients overload. Every queue bound
    stays wide, so what refuses is admission by predicted wait."""
    engine = args.engine.model_copy(update={"max_num_seqs": 4})
    return args.model_copy(update={"num_engine_replicas": 1, "engine": engine, "max_num_seqs": None})


async def timed_request(http: httpx.AsyncClient, i: int) -> tuple[int, float, str | None, str | None]:
    """(status, seconds, Retry-After, error code) of one 128-token completion with the test's deadline."""
    body = {"prompt": f"Request {i}: tell me a long story about the sea", "max_tokens": 128, "ignore_eos": True}
    start = time.monotonic()
    response = await http.post("/v1/completions", json=body, headers={"X-Request-Timeout": f"{DEADLINE_S:g}"})
    elapsed = time.monotonic() - start
    code = None if response.status_code == 200 else response.json()["error"]["code"]
    return response.status_code, elapsed, response.headers.get("retry-after"), code


async def at_once(base_url: str, count: int) -> list[tuple[int, float, str | None, str | None]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=DEADLINE_S + 30) as http:
        return await asyncio.gather(*(timed_request(http, i) for i in range(count)))


async def closed_loop(base_url: str, clients: int, seconds: float) -> list[tuple[int, float, str | None, str | None]]:
    """Each client sends, waits for the answer, and sends again; after a 503 it waits Retry-After, as OpenAI's
    SDK does. When time is up the clients hang up: what they left in flight is aborted, and not counted."""
    records: list[tuple[int, float, str | None, str | None]] = []
    stop_at = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=base_url, timeout=DEADLINE_S + 30,
                                 limits=httpx.Limits(max_connections=clients + 4)) as http:
        async def client(c: int) -> None:
            for i in range(10_000):
                record = await timed_request(http, c * 10_000 + i)
                records.append(record)
                if record[0] == 503:
                    await asyncio.sleep(min(float(record[2] or 1), max(stop_at - time.monotonic(), 0.0)))

        tasks = [asyncio.create_task(client(c)) for c in range(clients)]
        await asyncio.sleep(seconds)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return records


def test_overload_with_deadlines_is_refused_at_once_and_what_is_admitted_finishes_in_time(serve_app):
    serve_app.redeploy(deadline_args(serve_app.started_args))
    assert len(wait_for_replicas(serve_app, 1, 120)) == 1
    # What the replica serves at once, alone; this also gives it the step history its estimate needs.
    alone = asyncio.run(at_once(serve_app.base_url, 4))
    assert {status for status, *_ in alone} == {200}, alone
    service_s = max(seconds for _, seconds, *_ in alone)
    clients = min(96, max(12, round(OVERLOAD * 4 / service_s * DEADLINE_S)))
    records = asyncio.run(closed_loop(serve_app.base_url, clients, LOAD_S))
    statuses = Counter(status for status, *_ in records)
    print(f"{clients} clients, {service_s:.1f}s alone: {dict(statuses)}")
    assert set(statuses) <= {200, 503, 408}, statuses
    assert statuses[200] > 0 and statuses[503] > statuses[200], statuses  # 3x: most are turned away
    refusals = [(retry_after, code) for status, _, retry_after, code in records if status == 503]
    assert all(code == "server_overloaded" and int(retry_after) >= 1 for retry_after, code in refusals)
    assert max(int(retry_after) for retry_after, _ in refusals) > 1  # the replica's backlog, not a default
    past_deadline = statuses[408] + sum(1 for s, seconds, *_ in records if s == 200 and seconds > DEADLINE_S)
    assert past_deadline < 0.05 * len(records), (past_deadline, len(records))
    # Once the load stops, what the clients hung up on is aborted (admission counts it until then: a request
    # sent in that moment is refused on the backlog it sees), and the next request is served as fast as it
    # was alone.
    stats = wait_until_idle(serve_app, 30, num_replicas=1)
    assert all(s.num_running == 0 and s.num_waiting == 0 and s.num_used_kv_blocks == 0 for s in stats), stats
    [(status, seconds, _, _)] = asyncio.run(at_once(serve_app.base_url, 1))
    assert status == 200 and seconds < 1.5 * service_s + 2, (seconds, service_s)

    # No engine replica answers (the only one is frozen, so Serve does not replace it within seconds, as it
    # would a killed one): /health says so. Then it is killed (replacing a killed replica is the first test's).
    [pid] = replica_pids(ENGINE).values()
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        with httpx.Client(base_url=serve_app.base_url, timeout=30) as http:
            while (health := http.get("/health")).status_code == 200:
                assert time.monotonic() < deadline, "/health stayed 200 with no engine replica answering"
                time.sleep(0.5)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
    finally:
        os.kill(pid, signal.SIGKILL)
