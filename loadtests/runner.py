"""Drives one benchmark run: warm-up, then the profiling phase under a load mode, bounded by count and time."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass

from loadtests.arrivals import LoadMode, arrival_offsets
from loadtests.client import StreamingClient, never_started
from loadtests.openai_api import EndpointConfig
from loadtests.records import RequestRecord, RequestSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunLimits:
    """A run stops issuing requests at max_requests or duration_s, whichever comes first; in-flight requests
    then get grace_period_s to finish before they are cancelled (and counted as cancelled)."""

    max_requests: int | None = None
    duration_s: float | None = None
    grace_period_s: float = 30.0
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_requests is None and self.duration_s is None:
            raise ValueError("a run needs a request count or a duration")


@dataclass
class RunResult:
    mode: LoadMode
    records: list[RequestRecord]  # warm-up and profiling, in completion order
    start_ns: int  # wall clock when profiling began
    end_ns: int
    client_cpu_s: float  # this process's CPU time during profiling
    was_cancelled: bool  # some requests were cut off at the deadline

    @property
    def profiling(self) -> list[RequestRecord]:
        return [r for r in self.records if r.phase == "profiling"]

    @property
    def warmup(self) -> list[RequestRecord]:
        return [r for r in self.records if r.phase == "warmup"]


def spec_stream(specs: list[RequestSpec], max_requests: int | None, cycle: bool) -> Iterator[RequestSpec]:
    """The specs in order, cycled (renumbered) when a duration-bounded run needs more than were built."""
    n = 0
    while specs and (max_requests is None or n < max_requests):
        for spec in specs:
            if max_requests is not None and n >= max_requests:
                return
            yield spec if n == spec.index else dataclasses.replace(spec, index=n)
            n += 1
        if not cycle:
            return


class Progress:
    """A tqdm bar on stderr, or nothing."""

    def __init__(self, enabled: bool, total: int | None, desc: str) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc=desc, unit="req", leave=False, dynamic_ncols=True)
        self.errors = 0

    def done(self, record: RequestRecord) -> None:
        if self._bar is not None:
            self.errors += not record.ok
            self._bar.update(1)
            if self.errors:
                self._bar.set_postfix(errors=self.errors, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def _closed_loop(client: StreamingClient, specs: Iterator[RequestSpec], concurrency: int, phase: str,
                       deadline: float | None, records: list[RequestRecord], progress: Progress,
                       inflight: set[asyncio.Task[RequestRecord]]) -> None:
    """`concurrency` workers, each sending its next request as soon as its previous one finishes."""
    async def worker() -> None:
        for spec in specs:  # one shared iterator: each spec goes to exactly one worker
            if deadline is not None and time.monotonic() >= deadline:
                return
            task = asyncio.create_task(client.send(spec, phase))
            inflight.add(task)
            try:
                record = await task
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # the worker itself was cancelled
                record = never_started(spec, phase)
            inflight.discard(task)
            records.append(record)
            progress.done(record)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _open_loop(client: StreamingClient, timed: list[tuple[float, RequestSpec]], cap: int | None,
                     deadline: float | None, records: list[RequestRecord], progress: Progress,
                     inflight: set[asyncio.Task[RequestRecord]]) -> None:
    """Start each request at its offset (waiting for a free slot when capped), whatever is still in flight."""
    slots = asyncio.Semaphore(cap) if cap else None
    start = time.monotonic()

    def finished(task: asyncio.Task[RequestRecord], spec: RequestSpec, offset: float) -> None:
        inflight.discard(task)
        if slots is not None:
            slots.release()
        # send() turns every failure, a cancellation included, into a record; only a task cancelled before it ran
        # has none
        record = never_started(spec, "profiling", offset) if task.cancelled() else task.result()
        records.append(record)
        progress.done(record)

    for offset, spec in timed:
        if deadline is not None and start + offset >= deadline:
            break
        delay = start + offset - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if slots is not None:
            await slots.acquire()
            if deadline is not None and time.monotonic() >= deadline:
                slots.release()  # the slot came free after the deadline: the run sends nothing more
                break
        task = asyncio.create_task(client.send(spec, "profiling", scheduled_offset_s=offset))
        inflight.add(task)
        task.add_done_callback(lambda t, spec=spec, offset=offset: finished(t, spec, offset))
    while inflight:
        await asyncio.wait(set(inflight))


def _timed_specs(mode: LoadMode, specs: list[RequestSpec], limits: RunLimits) -> list[tuple[float, RequestSpec]]:
    if mode.trace:
        chosen = specs[: limits.max_requests] if limits.max_requests is not None else specs
        return [(s.send_offset_s or 0.0, s) for s in chosen]
    assert mode.rate is not None
    n = limits.max_requests
    if n is None:  # duration only: enough arrivals to outlast the deadline
        n = math.ceil(mode.rate * (limits.duration_s or 0.0) * 1.5) + 16
    offsets = arrival_offsets(n, mode.rate, mode.arrival, mode.burstiness, mode.seed)
    return list(zip(offsets, spec_stream(specs, n, cycle=True)))


async def run_load(endpoint: EndpointConfig, mode: LoadMode, specs: list[RequestSpec], limits: RunLimits,
                   warmup_specs: list[RequestSpec] | None = None, progress: bool = True) -> RunResult:
    """Warm up, then profile; every request sent is in the result, failed or cancelled ones included."""
    records: list[RequestRecord] = []
    inflight: set[asyncio.Task[RequestRecord]] = set()
    async with StreamingClient(endpoint, limits.request_timeout_s, max_connections=mode.concurrency or 0) as client:
        if warmup_specs:
            bar = Progress(progress, len(warmup_specs), "warm-up")
            await _closed_loop(client, iter(warmup_specs), min(mode.concurrency or 1, len(warmup_specs)),
                               "warmup", None, records, bar, inflight)
            bar.close()
        deadline = time.monotonic() + limits.duration_s if limits.duration_s is not None else None
        if mode.trace or mode.rate is not None:
            timed = _timed_specs(mode, specs, limits)
            bar = Progress(progress, len(timed) if limits.duration_s is None else None, mode.label)
            load = _open_loop(client, timed, mode.concurrency, deadline, records, bar, inflight)
        else:
            bar = Progress(progress, limits.max_requests if limits.duration_s is None else None, mode.label)
            stream = spec_stream(specs, limits.max_requests, cycle=limits.duration_s is not None)
            load = _closed_loop(client, stream, mode.concurrency or 1, "profiling", deadline, records, bar, inflight)
        cpu0, start_ns = time.process_time(), time.time_ns()
        was_cancelled = await _finish(load, deadline, limits.grace_period_s, inflight)
        cpu_s, end_ns = time.process_time() - cpu0, time.time_ns()
        bar.close()
    return RunResult(mode, records, start_ns, end_ns, cpu_s, was_cancelled)


async def _finish(load: Coroutine[object, object, None], deadline: float | None, grace_s: float,
                  inflight: set[asyncio.Task[RequestRecord]]) -> bool:
    """Await the load; past deadline + grace, cancel what is in flight (each cancelled request is still recorded)."""
    task = asyncio.ensure_future(load)
    if deadline is None:
        await task
        return False
    while not task.done():
        remaining = deadline + grace_s - time.monotonic()
        if remaining <= 0:
            break
        await asyncio.wait({task}, timeout=remaining)
    if task.done():
        task.result()
        return False
    log.warning("cancelling %d requests still in flight %.0f s after the deadline", len(inflight), grace_s)
    for request in list(inflight):
        request.cancel()
    await task
    return True
