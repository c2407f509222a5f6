"""AsyncEngine: LLMEngine's step loop on its own thread, streaming outputs to asyncio consumers.

The event loop never runs a step: a request is validated on the caller's side, handed to the step thread
through a queue, and its outputs come back through an asyncio.Queue per request. Outputs that pile up
while the consumer is busy are merged into one, so a slow consumer receives fewer, larger messages.

A step that fails ends its own requests (their final output carries a RequestFailure) and the loop goes on.
Anything that escapes a step leaves the engine's state unknown: the loop stops, every stream gets
EngineDeadError, and `on_death` is called (an engine replica exits, so that it is replaced at once).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.backlog import Job
from engine.config import EngineConfig
from engine.failures import FailureKind, RequestFailure, leaves_state_unknown
from engine.huge_pages import release_free_heap
from engine.llm_engine import LLMEngine
from engine.outputs import EngineOutput, EngineStartup, EngineStats, ModelInfo, SchedulerStats
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.tenancy import DEFAULT_TENANCY, Tenancy
from engine.tp_group import RankFailure

log = logging.getLogger(__name__)

HASHES_PERIOD_S = 0.1  # how stale, at most, the published cached block hashes are while the engine is busy


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    deadline: float | None
    tenancy: Tenancy = DEFAULT_TENANCY


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """A function to run on the step thread between two steps (the profiler must start and stop there)."""

    fn: Callable[[], Any]
    done: concurrent.futures.Future


HEAP_TRIM_INTERVAL_S = 5.0


class EngineDeadError(RuntimeError):
    pass


class EngineOverloadedError(RuntimeError):
    """The waiting queue is at `max_num_waiting`: the caller should try again later (or elsewhere)."""


class AsyncEngine:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None,
                 on_death: Callable[[BaseException], None] | None = None) -> None:
        """`on_death` is called on the step thread once the loop has stopped on an error, after every stream
        was told."""
        self.engine = engine or LLMEngine(config)
        self._on_death = on_death
        core = self.engine
        self._model_info = ModelInfo(limits=core.limits, eos_token_ids=tuple(core.eos_token_ids),
                                     attention_backend=core.runner.attention_backend, device=core.config.device,
                                     cuda_graphs=core.cuda_graphs)
        # Published by the step thread after each step, so other threads read them without touching its state.
        self.publish_block_hashes = False  # set by a caller that reads cached_block_hashes()
        self._recent_steps: tuple[SchedulerStats, ...] = ()
        self._block_hashes = np.zeros(0, dtype=np.uint64)
        self._block_hashes_at = 0.0  # time.monotonic() of the last publish
        self._inbox: queue.Queue[_Add | _Abort | _Call | None] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._pending: dict[str, Job] = {}  # accepted, not yet in the scheduler's queues
        self._pending_tenants: dict[str, str] = {}  # their tenants, by request id
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._thread.is_alive() and self.engine.rank_failure() is None

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration as it runs (a backend may have changed block_size)."""
        return self.engine.config

    @property
    def startup(self) -> EngineStartup:
        return self.engine.startup

    def model_info(self) -> ModelInfo:
        return self._model_info

    def recent_steps(self) -> list[SchedulerStats]:
        """The last `step_history` steps, oldest first, as of the last step that ended."""
        return list(self._recent_steps)

    def cached_block_hashes(self) -> np.ndarray:
        """The prefix cache's block hashes as of a step at most HASHES_PERIOD_S old, or of the last step once idle
        (empty unless publish_block_hashes)."""
        return self._block_hashes

    def rank_failure(self) -> RankFailure | None:
        """Why a tensor-parallel rank can no longer serve; None if all can (or there is one device)."""
        return self.engine.rank_failure()

    @property
    def num_waiting(self) -> int:
        """Requests accepted and not running yet: in the scheduler's queue or still in the inbox."""
        return max(0, len(self._streams) - len(self.engine.scheduler.running))

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, n: int = 1) -> None:
        """Raises InvalidRequestError for a request this engine cannot run (engine.request_limits)."""
        self.engine.validate(prompt_token_ids, params, n)

    def has_room(self, num_requests: int = 1, tenant: str | None = None) -> bool:
        """Room in the waiting queue (`max_num_waiting`). When it is full, a tenant with nothing queued still gets
        one request in: one tenant flooding the queue does not shut the others out."""
        limit = self.engine.config.max_num_waiting
        if limit is None or self.num_waiting + num_requests <= limit:
            return True
        if tenant is None or num_requests > 1 or self.engine.scheduler.waiting.count(tenant):
            return False
        with self._lock:
            return tenant not in self._pending_tenants.values()

    def predicted_wait_s(self) -> float | None:
        """Seconds until a request accepted now could start, after what this engine holds and what it accepted
        and has not queued yet; None while it cannot estimate (engine.backlog)."""
        with self._lock:
            pending = list(self._pending.values())
        return self.engine.predicted_wait_s(pending)

    def predicted_finish_s(self, num_prompt_tokens: int, params: SamplingParams,
                           n: int = 1) -> tuple[float, float] | None:
        """(seconds until n choices of this request, accepted now, would finish; seconds they take on an idle
        engine), or None while there is no estimate."""
        jobs = [self.engine.output_lengths.job_of_new(num_prompt_tokens, params)] * n
        with self._lock:
            pending = list(self._pending.values())
        return self.engine.predicted_finish_s(jobs, pending)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       arrival_time: float | None = None,
                       deadline: float | None = None,
                       tenancy: Tenancy = DEFAULT_TENANCY) -> AsyncIterator[EngineOutput]:
        """Streams outputs until the request finishes; closing the iterator aborts the request. A request still
        waiting at `deadline` (time.time()) is dropped: its final output carries the failure."""
        if not self.is_healthy:
            raise EngineDeadError(f"the engine step loop has stopped: {self.error or self.engine.rank_failure()!r}")
        request_id = request_id or uuid.uuid4().hex
        self.engine.validate(prompt_token_ids, params)  # raises before anything is queued
        if not self.has_room(1, tenancy.tenant):
            raise EngineOverloadedError(f"{self.num_waiting} requests are already waiting "
                                        f"(max_num_waiting={self.engine.config.max_num_waiting})")
        outputs: asyncio.Queue[EngineOutput | BaseException] = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already running", "request_id")
            self._streams[request_id] = (asyncio.get_running_loop(), outputs)
            self._pending[request_id] = self.engine.output_lengths.job_of_new(len(prompt_token_ids), params)
            self._pending_tenants[request_id] = tenancy.tenant
        self._send(_Add(request_id, list(prompt_token_ids), params, arrival_time or time.time(), deadline, tenancy))
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                while not outputs.empty() and isinstance(item, EngineOutput):
                    more = outputs.get_nowait()
                    if isinstance(more, BaseException):
                        item = more
                        break
                    item = item.merge(more)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
                self._pending.pop(request_id, None)
                self._pending_tenants.pop(request_id, None)
            if not finished:
                self._send(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    async def run_on_step_thread(self, fn: Callable[[], Any], timeout_s: float = 60.0) -> Any:
        """Runs `fn` on the step thread between two steps and returns its result."""
        if not self.is_healthy:
            raise EngineDeadError("the engine step loop has stopped")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Call(fn, done))
        return await asyncio.wait_for(asyncio.wrap_future(done), timeout_s)

    def _send(self, message: _Add | _Abort | _Call | None) -> None:
        self._inbox.put(message)
        self._wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped = True
        self._send(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.close()

    def _run(self) -> None:
        engine = self.engine
        busy_since_trim, last_trim = False, time.monotonic()
        try:
            while not self._stopped:
                self._drain_inbox()
                if not engine.has_unfinished():
                    # Idle: hand the heap the last requests freed back to the OS (at most every few seconds: it walks
                    # every malloc arena).
                    if busy_since_trim and time.monotonic() - last_trim >= HEAP_TRIM_INTERVAL_S:
                        release_free_heap()
                        busy_since_trim, last_trim = False, time.monotonic()
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                busy_since_trim = True
                outputs = engine.step()
                self._publish()  # before delivering: whoever reads a step's outputs sees what it left behind
                for out in outputs:
                    self._deliver(out.request_id, out)
        except BaseException as exc:  # the loop must tell every waiter, whatever killed it
            log.critical("engine step loop died; the engine's state is unknown", exc_info=exc)
            self.error = exc
            with self._lock:
                streams = list(self._streams)
            for request_id in streams:
                self._deliver(request_id, EngineDeadError("the engine step loop died"))
            if self._on_death is not None:
                self._on_death(exc)

    def _publish(self) -> None:
        """On the step thread, between steps: what other threads read (a tuple and an array, swapped whole)."""
        self._recent_steps = tuple(self.engine.step_history)
        if not self.publish_block_hashes:
            return
        # Copying every cached hash costs tens of microseconds at a few thousand blocks, and readers look about
        # once a second: while busy at most every HASHES_PERIOD_S, and always once the engine has gone idle.
        now = time.monotonic()
        if now - self._block_hashes_at >= HASHES_PERIOD_S or not self.engine.has_unfinished():
            self._block_hashes = self.engine.kv.pool.cached_hashes()
            self._block_hashes_at = now

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if message is None:
                return
            if isinstance(message, _Abort):
                self.engine.abort(message.request_id)
                continue
            if isinstance(message, _Call):
                try:
                    message.done.set_result(message.fn())
                except Exception as exc:  # handed to the caller, never fatal to the loop
                    message.done.set_exception(exc)
                continue
            with self._lock:
                alive = message.request_id in self._streams
                self._pending.pop(message.request_id, None)
                self._pending_tenants.pop(message.request_id, None)
            if not alive:
                continue  # its consumer left before the step loop saw it
            try:
                self.engine.add_request(message.request_id, message.prompt_token_ids, message.params,
                                        message.arrival_time, message.deadline, validated=True,
                                        tenancy=message.tenancy)
            except InvalidRequestError as exc:
                self._deliver(message.request_id, exc)
            except Exception as exc:
                if leaves_state_unknown(exc):
                    raise
                log.exception("adding request %s failed", message.request_id)
                self.engine.requests.pop(message.request_id, None)
                failure = RequestFailure(FailureKind.STEP_FAILED, "the engine could not queue this request",
                                         "engine_step_failed")
                self._deliver(message.request_id, EngineOutput(message.request_id, [], True, "error",
                                                               failure=failure))

    def _deliver(self, request_id: str, item: EngineOutput | BaseException) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is None:
            if isinstance(item, EngineOutput) and not item.finished:
                self.engine.abort(request_id)  # nobody is listening any more
            return
        loop, outputs = target
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:
            self.engine.abort(request_id)  # the consumer's loop is closed
