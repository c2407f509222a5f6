"""EngineReplica: one AsyncEngine behind a Ray Serve deployment, streaming token ids to the ingress.

A caller that goes away cancels `generate`; the cancellation runs through the engine's stream, which aborts the
request and frees its blocks. Chunks go out once per engine step, or at most once per `stream_interval_s` (while
more than `stream_interval_min_streams` requests stream): the engine merges what piles up meanwhile, so a busy
replica sends fewer, larger messages. A request that names its ingress's token channel gets every chunk over the
channel, every chunk of a step for that ingress in one message (deployments/token_channel.py); its Serve stream
carries a refusal or a failure, or ends with a ChannelEnd.

Admission: a request is refused at once (503, Retry-After = this replica's backlog: the wait before it could
start) when, behind what the replica holds, it would finish past ADMIT_WAIT_FRACTION of the time left before its
deadline, and alone it would not (waiting cannot help a request that is longer than its deadline: it runs, and
the deadline cuts it). While the engine cannot estimate yet, the count bound (`engine.max_num_waiting`) alone
decides. A request that fails inside the engine
gets a RequestRejected saying how; if the engine itself dies, this process exits so Serve replaces it at once.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import psutil
import ray

from deployments.autoscaling_config import replica_load
from deployments.block_digest import replica_digest_bits, with_block_digest
from deployments.config import AppArgs
from deployments.context import log_through_serve, replica_id
from deployments.engine_metrics import EngineMetrics
from deployments.limits import ADMIT_WAIT_FRACTION
from deployments.records import (ColdStart, EngineRequest, EngineTimeline, GenerationChunk, ProfileResult,
                                 ReplicaStats, ReplicaSteps, RequestRejected)
from deployments.token_channel import ChannelEnd, ChannelLinks, coalescing_interval, relay
from deployments.tp_ranks import RayRanks
from engine import AsyncEngine, EngineOutput, InvalidRequestError, LLMEngine
from engine.failures import FailureKind, RequestFailure
from engine.outputs import ModelInfo
from engine.profiler import StepProfiler, write_chrome_trace

log = logging.getLogger(__name__)

PREEMPTION_WINDOW_S = 10.0  # record_autoscaling_stats reports preemptions per second over this window
EXIT_GRACE_S = 0.5  # a dying replica lets its streams carry the error out before the process exits
FAILURE_STATUS = {FailureKind.INVALID_REQUEST: 400, FailureKind.DEADLINE_PASSED: 408, FailureKind.STEP_FAILED: 500}


class ChoiceFailed(Exception):
    """One choice of a request ended with a RequestFailure inside the engine."""

    def __init__(self, failure: RequestFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class EngineReplica:
    async def __init__(self, args: AppArgs) -> None:
        started = time.perf_counter()
        log_through_serve()
        config = args.engine_config()
        self.replica_id = replica_id()
        self._exiting = False
        # Tensor parallelism: the other ranks run as actors in this replica's placement group.
        core = LLMEngine(config, ranks=RayRanks(self.replica_id, args.engine_num_cpus, args.engine_num_gpus)) \
            if config.tensor_parallel_size > 1 else None
        self.engine = AsyncEngine(config, core, on_death=self._exit_on_engine_death)
        self.retry_after_s = args.limits.retry_after_s
        self.stream_interval_s = args.stream_interval_s
        self.stream_interval_min_streams = args.stream_interval_min_streams
        self._links = ChannelLinks()
        info = self.engine.model_info()
        self.metrics = EngineMetrics(args.model_name(), self.replica_id, info.limits.max_model_len)
        self.metrics.record_engine_info(info.attention_backend, config.device, config.dtype, info.cuda_graphs)
        self._num_active_streams = 0
        self._digest_bits = replica_digest_bits(args.router, info.limits.num_kv_blocks)
        self.engine.publish_block_hashes = self._digest_bits > 0
        self._stats_task = asyncio.create_task(self._record_stats_forever(args.stats_interval_s))
        self.timelines = args.timeline.enabled
        self.profiler_dir = Path(args.profiler_dir).expanduser() if args.profiler_dir else None
        self.profiler = StepProfiler(config.device)
        self.load = replica_load(args.autoscaling)  # the capacity and offered load the SLO policy reads
        self._cold_start = ColdStart(self.replica_id, psutil.Process().create_time(), time.time(),
                                     time.perf_counter() - started, self.engine.startup)
        log.info("engine replica %s ready: %s on %s, attention backend %s, CUDA graphs %s, %d torch threads; "
                 "cold start %s", self.replica_id, config.model, config.device, info.attention_backend,
                 info.cuda_graphs, config.num_threads, self._cold_start)

    async def generate(self, request: EngineRequest
                       ) -> AsyncIterator[list[GenerationChunk] | RequestRejected | ChannelEnd]:
        """Streams lists of chunks (one per choice that advanced), or one RequestRejected for a bad request; with
        the token channel, the chunks go over it and the stream ends with a ChannelEnd."""
        entered = time.monotonic()
        prompts = request.prompts
        num_choices = request.n * len(prompts)
        try:
            refusal = self._refusal(request)
        except Exception:  # a check that broke is this request's failure, never the replica's
            log.exception("request %s: checking it failed", request.request_id)
            refusal = RequestRejected("the engine replica could not check this request", code="internal_error",
                                      status=500)
        if refusal is not None:
            yield refusal
            return
        link = await self._links.link(request.channel) if request.channel is not None else None
        for prompt in prompts:
            self.metrics.record_arrival(request.n, request.sampling.max_tokens)
            if self.load is not None:
                for _ in range(request.n):
                    self.load.arrived(time.time(), len(prompt), request.sampling.max_tokens)
        self._num_active_streams += 1
        try:
            choices = [self._choice(request, prompt, i * request.n + j, j, entered)
                       for i, prompt in enumerate(prompts) for j in range(request.n)]
            batches = _one_by_one(choices[0]) if num_choices == 1 else _merged(choices)
            lost = functools.partial(RequestRejected, "the engine replica lost its connection to the ingress",
                                     code="token_channel_lost", status=500)
            interval = self._stream_interval if self.stream_interval_s else 0.0
            async for item in relay(batches, link, request.channel_key, lost, interval, _ends_after(num_choices)):
                yield item
        except ChoiceFailed as exc:
            failure = exc.failure
            yield RequestRejected(failure.message, failure.param, failure.code, FAILURE_STATUS[failure.kind])
        finally:
            self._num_active_streams -= 1

    def _stream_interval(self) -> float:
        return coalescing_interval(self.stream_interval_s, self.stream_interval_min_streams, self._num_active_streams)

    def _refusal(self, request: EngineRequest) -> RequestRejected | None:
        """Why this replica will not take the request, if it will not: its input, a full queue, or no time."""
        prompts = request.prompts
        num_choices = request.n * len(prompts)
        try:
            for prompt in prompts:
                self.engine.validate(prompt, request.sampling, request.n)
        except InvalidRequestError as exc:
            return RequestRejected(str(exc), exc.param, exc.code)
        if not self.engine.has_room(num_choices, request.tenancy.tenant):
            limit = self.engine.config.max_num_waiting
            return RequestRejected(f"the engine replica's waiting queue is full ({limit} requests, "
                                   f"engine.max_num_waiting); retry shortly", code="server_overloaded", status=503,
                                   retry_after_s=self.retry_after_s)
        if request.deadline is None:
            return None
        backlog_s = self.engine.predicted_wait_s()
        estimate = self.engine.predicted_finish_s(max(map(len, prompts)), request.sampling, num_choices)
        if backlog_s is None or estimate is None:
            return None  # no estimate yet: the count bound above decides alone
        finish_s, alone_s = estimate
        limit_s = ADMIT_WAIT_FRACTION * (request.deadline - time.time())
        if finish_s <= limit_s or alone_s > limit_s:
            return None
        return RequestRejected(f"this engine replica is {backlog_s:.1f}s behind: this request would finish in about "
                               f"{finish_s:.0f}s, past {ADMIT_WAIT_FRACTION:.0%} of the time left before its deadline; "
                               f"retry later", code="server_overloaded", status=503,
                               retry_after_s=max(backlog_s, self.retry_after_s))

    async def _choice(self, request: EngineRequest, prompt: list[int], index: int, sample: int,
                      entered: float) -> AsyncIterator[GenerationChunk]:
        """Choice `index` of the request: its prompt's `sample`-th sample (n seeded samples must differ)."""
        params = request.sampling.for_choice(sample)
        last_token_time: float | None = None
        first_chunk_s: float | None = None
        async for out in self.engine.generate(prompt, params, f"{request.request_id}-{index}",
                                              request.arrival_time or None, request.deadline,
                                              request.tenancy):
            if out.failure is not None:
                self.metrics.record_finished("error", out.num_prompt_tokens, out.num_output_tokens, out.timings)
                raise ChoiceFailed(out.failure)
            now = time.time()
            if out.new_token_ids:
                if last_token_time is None:
                    self.metrics.record_first_token(now - (request.arrival_time or now))
                else:
                    self.metrics.record_token_gap(now - last_token_time, len(out.new_token_ids))
                last_token_time = now
            if out.finished:
                self.metrics.record_finished(out.finish_reason or "abort", out.num_prompt_tokens,
                                             out.num_output_tokens, out.timings)
                self.metrics.record_tenant_usage(request.tenancy.tenant, out.num_prompt_tokens,
                                                 out.num_cached_tokens, out.num_output_tokens)
                if self.load is not None:
                    self.load.finished(out.num_prompt_tokens, out.num_cached_tokens, out.num_output_tokens)
            timeline = None
            if self.timelines:
                offset = time.monotonic() - entered
                first_chunk_s = offset if first_chunk_s is None else first_chunk_s
                if out.finished:
                    timeline = self._engine_timeline(out, entered, first_chunk_s, offset)
            if out.timings is not None:  # the ingress reads them as `timeline`, or not at all
                out = dataclasses.replace(out, timings=None)
            yield GenerationChunk(index, out, timeline)

    def _engine_timeline(self, out: EngineOutput, entered: float, first_chunk_s: float,
                         end_s: float) -> EngineTimeline | None:
        timings = out.timings
        if timings is None or timings.events is None:
            return None
        return EngineTimeline(replica_id=self.replica_id,
                              events=[(e.time - entered, int(e.kind), e.value) for e in timings.events],
                              first_chunk_s=first_chunk_s, end_s=end_s, num_decode_steps=timings.num_decode_steps,
                              num_preemptions=out.num_preemptions, num_cached_tokens=out.num_cached_tokens,
                              num_dropped_events=timings.num_dropped_events)

    async def step_trace(self, since: float) -> ReplicaSteps:
        """The engine steps that started at or after `since` (time.time()), from the bounded step ring."""
        steps = [s for s in self.engine.recent_steps() if s.time >= since]
        return ReplicaSteps(replica_id=self.replica_id, pid=os.getpid(),
                            node_id=ray.get_runtime_context().get_node_id(), now=time.time(), steps=steps)

    async def start_profile(self) -> ProfileResult:
        """Starts the torch profiler on the step thread (`profiler_dir` must be set; the ingress checks)."""
        if self.profiler_dir is None:
            return ProfileResult(self.replica_id, running=False, changed=False)
        changed = await self.engine.run_on_step_thread(self.profiler.start)
        return ProfileResult(self.replica_id, running=True, changed=changed)

    async def stop_profile(self) -> ProfileResult:
        """Stops the profiler and writes its Chrome trace to `profiler_dir`, one file per replica and profile."""
        finished = await self.engine.run_on_step_thread(self.profiler.stop)
        if finished is None or self.profiler_dir is None:
            return ProfileResult(self.replica_id, running=False, changed=False)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = self.profiler_dir / f"{stamp}-engine-{self.replica_id}.pt.trace.json"
        await asyncio.to_thread(write_chrome_trace, finished, path)
        log.info("profile written to %s", path)
        return ProfileResult(self.replica_id, running=False, changed=True, path=str(path))

    async def cold_start(self) -> ColdStart:
        return self._cold_start

    async def model_info(self) -> ModelInfo:
        return self.engine.model_info()

    async def stats(self) -> ReplicaStats:
        return self._stats()

    def _stats(self) -> ReplicaStats:
        s = self.engine.stats()
        return ReplicaStats(**dataclasses.asdict(s), replica_id=self.replica_id,
                            num_used_kv_blocks=s.num_kv_blocks - s.num_free_kv_blocks,
                            num_active_streams=self._num_active_streams, backlog_s=self.engine.predicted_wait_s())

    def record_routing_stats(self) -> dict[str, float | str | bytes]:
        """Ray Serve's request-router hook, every routing-stats period: load, and a digest of the prefix cache."""
        stats = dataclasses.replace(self._stats(), reported_at=time.time())
        if self._digest_bits:
            stats = with_block_digest(stats, self.engine.cached_block_hashes(), self.engine.config.block_size,
                                      self._digest_bits)
        return dataclasses.asdict(stats)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom-autoscaling hook: read by autoscaling.policy as `ctx.aggregated_metrics` (each key
        averaged over the look-back window, per replica). Numbers only, as Serve requires."""
        s = self.engine.stats()
        now = time.time()
        steps = self.engine.recent_steps()
        preempted = sum(step.num_preempted for step in steps if step.time >= now - PREEMPTION_WINDOW_S)
        stats = {"kv_usage": s.kv_usage, "num_waiting": float(s.num_waiting), "num_running": float(s.num_running),
                 "preemptions_per_s": preempted / PREEMPTION_WINDOW_S, "num_kv_blocks": float(s.num_kv_blocks)}
        if self.load is not None:
            self.load.add_steps(steps)
            stats.update(self.load.metrics(now))
        return stats

    def check_health(self) -> None:
        """Covers every tensor-parallel rank: an idle replica whose rank died exits too, so Serve replaces it."""
        if not self.engine.is_healthy:
            failure = self.engine.rank_failure()
            if failure is not None:
                self._exit_on_engine_death(failure)
            raise RuntimeError(f"engine is down: {self.engine.error or failure!r}")

    def _exit_on_engine_death(self, error: BaseException) -> None:
        """Called on the step thread when the engine's state is unknown: a replica that stayed up would keep being
        routed to (Serve's health check takes three failed periods to act), and its requests would all fail."""
        if self._exiting:
            return
        self._exiting = True
        log.critical("engine replica %s exits in %.1fs: its engine died (%s)", self.replica_id, EXIT_GRACE_S,
                     type(error).__name__)

        def exit_now() -> None:
            for handler in logging.getLogger().handlers:
                handler.flush()
            sys.stderr.flush()
            os._exit(1)

        threading.Timer(EXIT_GRACE_S, exit_now).start()

    async def _record_stats_forever(self, interval_s: float) -> None:
        while True:
            try:
                self.metrics.record_engine(self.engine.stats(), self.engine.recent_steps())
            except Exception:  # metrics must never take the replica down
                log.exception("recording engine metrics failed")
            await asyncio.sleep(interval_s)

    def __del__(self) -> None:
        self._links.close()
        self.engine.shutdown(timeout=5.0)


def _ends_after(num_choices: int) -> Callable[[list[GenerationChunk]], bool]:
    """Whether a batch is a request's last: the one in which the last of its choices finished."""
    finished = 0

    def is_last(batch: list[GenerationChunk]) -> bool:
        nonlocal finished
        finished += sum(1 for chunk in batch if chunk.output.finished)
        return finished >= num_choices

    return is_last


async def _one_by_one(stream: AsyncIterator[GenerationChunk]) -> AsyncIterator[list[GenerationChunk]]:
    async for chunk in stream:
        yield [chunk]


async def _merged(streams: list[AsyncIterator[GenerationChunk]]) -> AsyncIterator[list[GenerationChunk]]:
    """Interleaves the choices of one request; cancelling the consumer cancels (and so aborts) every choice."""
    queue: asyncio.Queue[GenerationChunk | Exception] = asyncio.Queue()

    async def pump(stream: AsyncIterator[GenerationChunk]) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait(chunk)
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    remaining = len(streams)
    try:
        while remaining:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            for item in batch:
                if isinstance(item, Exception):
                    raise item
            remaining -= sum(1 for chunk in batch if chunk.output.finished)
            yield batch
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

