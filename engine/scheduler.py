"""Continuous batching: which requests run this step, and how many tokens each computes.

There is no prefill phase and no decode phase: each request catches up from ``num_computed_tokens`` to
``num_tokens`` under the step's token budget. A decode is a request one token behind.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.failures import FailureKind, RequestFailure
from engine.kv_cache_manager import KVCacheManager
from engine.request import EventKind, Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def is_decode(self) -> bool:
        """One new token past the prompt (read before the step advances the request)."""
        return self.num_new_tokens == 1 and self.request.num_computed_tokens >= self.request.num_prompt_tokens

    @property
    def samples(self) -> bool:
        """A request samples only when this step brings it level with its tokens (not mid-prefill)."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    expired: list[Request] = field(default_factory=list)  # dropped from the queue, their deadline passed
    considering: Request | None = None  # the request being placed when scheduling stopped, if it failed

    def batch(self) -> list[Request]:
        """Every request this step holds (or was placing): what a failed step fails."""
        requests = [s.request for s in self.scheduled]
        if self.considering is not None and self.considering not in requests:
            requests.append(self.considering)
        return requests

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.last_output = SchedulerOutput()  # the step being scheduled, or the last one

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        request.timings.queued = time.time()
        request.timings.record(EventKind.ENQUEUED)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = self.last_output = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = time.time()
        self._drop_expired(now, out)

        i = 0
        while i < len(self.running) and budget > 0:
            request = out.considering = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, num_new):
                # Out of blocks: preempt the newest running request (never one already scheduled this step).
                victim = self.running.pop()
                self._preempt(victim, now)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                i += 1

        # Admitting new work while preempting would only thrash the pool.
        skipped = 0  # requests at the head whose grammar still compiles: they keep their place, others go
        while len(self.waiting) > skipped and budget > 0 and len(self.running) < self.max_num_seqs \
                and not out.preempted:
            request = self.waiting[skipped]
            if not request.ready:
                skipped += 1
                continue
            out.considering = request
            hits, num_cached = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(request, num_new, hits):
                break
            del self.waiting[skipped]
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            if request.status == RequestStatus.PREEMPTED:
                request.timings.resumptions.append(now)
                request.timings.record(EventKind.RESUMED)
            elif request.timings.first_scheduled is None:
                request.timings.first_scheduled = now
                request.timings.record(EventKind.SCHEDULED)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        out.considering = None
        return out

    def _drop_expired(self, now: float, out: SchedulerOutput) -> None:
        """A waiting request whose deadline passed is finished before any prefill is spent on it."""
        if not any(r.deadline is not None and r.deadline < now for r in self.waiting):
            return
        for request in [r for r in self.waiting if r.deadline is not None and r.deadline < now]:
            request.failure = RequestFailure(FailureKind.DEADLINE_PASSED, "the request's deadline passed while it "
                                             "waited for the engine", "request_timeout")
            self.finish(request, RequestStatus.FINISHED_ERROR)
            out.expired.append(request)

    def _preempt(self, request: Request, now: float) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.timings.preemptions.append(now)
        request.timings.record(EventKind.PREEMPTED)
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus, num_valid_tokens: int | None = None) -> None:
        """Free a request's blocks and drop it from whichever queue holds it. `num_valid_tokens`: only that many
        of its tokens have KV computed (a failed step), so blocks past them leave the prefix cache."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.is_finished:
            self.waiting.remove(request)
        request.status = status
        request.timings.finished = time.time()
        request.timings.record(EventKind.FINISHED, int(status))
        self.kv.free(request, num_valid_tokens)
