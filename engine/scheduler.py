"""Continuous batching: which requests run this step, and how many tokens each computes.

There is no prefill phase and no decode phase: each request catches up from ``num_computed_tokens`` to
``num_tokens`` under the step's token budget. A decode is a request one token behind.

Order: waiting requests are admitted by priority (lower first), then by tenant fair share, then by arrival
(engine.tenancy.WaitingQueue); with a TTFT objective (`ttft_objective_s`), those that can still meet it go before
those that waited past half of it. `running` is kept in (priority, admission) order, so a request short of blocks
preempts the lowest-priority, newest one first; a waiting request that outranks running ones takes their
blocks and batch slots when it could not start otherwise.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from engine.failures import FailureKind, RequestFailure
from engine.kv_cache_manager import KVCacheManager
from engine.request import EventKind, Request, RequestStatus, TokenLogprobs
from engine.tenancy import FairShare, WaitingQueue


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
    def is_empty(self) -> bool:
        return not self.scheduled


# A waiting request with no first token is late (queued behind those on time) after this share of the TTFT objective.
LATE_SHARE = 0.5

# A newcomer tenant's first prefill may run without the running requests' decodes in at most one step of this many.
SOLO_STEP_PERIOD = 4


def step_budget(max_num_batched_tokens: int, max_tokens_with_decodes: int | None, decoding: int) -> int:
    """A step's tokens with `decoding` running requests decoding: max_num_batched_tokens, or max_tokens_with_decodes
    while requests decode (never fewer than they are: every decode keeps its step). autoscaling/step_model.py's
    EngineShape.budget restates it for the simulator, which does not import the engine."""
    full, cap = max_num_batched_tokens, max_tokens_with_decodes
    if cap is None or cap >= full or not decoding:
        return full
    return min(full, max(cap, decoding))


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, fair: FairShare | None = None,
                 max_tokens_with_decodes: int | None = None, ttft_objective_s: float | None = None) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_tokens_with_decodes = max_tokens_with_decodes
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.fair = fair or FairShare()
        # Late once half the objective has passed: the other half is left for its prefill, which under load runs in
        # chunks beside the running streams (on a simulated replica at 1.2-3x its capacity, more requests met a 2 s
        # objective with the line at 1 s than at 2 s: python -m benchmarks.late_queue).
        late_after_s = None if ttft_objective_s is None else ttft_objective_s * LATE_SHARE
        self.waiting = WaitingQueue(self.fair, late_after_s)
        self.running: list[Request] = []  # in (priority, admission) order: the last is preempted first
        self._num_admitted = 0
        self.num_preemptions = 0
        self._steps_since_solo = SOLO_STEP_PERIOD  # steps since one ran a newcomer's first prefill alone
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
        now = time.time()
        self._drop_expired(now, out)
        self.waiting.demote_late(now)
        self._preempt_for_priority(now, out)
        sharing = len(self.fair.counters) > 1  # one tenant alone needs no share kept for others
        if sharing:
            self._preempt_for_fair_share(now, out)
        busy_tenants = {r.tenancy.tenant for r in self.running} if sharing else set()
        self._steps_since_solo += 1
        if sharing and self._first_prefill_goes_alone(busy_tenants):
            self._admit_waiting(out, self.max_num_batched_tokens, now, busy_tenants, protecting=True)
            if out.scheduled:
                self._steps_since_solo = 0
                self._finish_schedule(out, sharing)
                return out

        budget = self._budget()
        i = 0
        short_of_blocks = False
        while i < len(self.running) and budget > 0:
            request = out.considering = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, num_new):
                # Out of blocks: preempt the lowest-priority, newest running request (never one already scheduled
                # this step: those sit before i).
                short_of_blocks = True
                victim = self.running.pop()
                self._preempt(victim, now)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                i += 1

        # Admitting new work while short of blocks would only thrash the pool.
        if not short_of_blocks:
            self._admit_waiting(out, budget, now, busy_tenants, protecting=False)
        self._finish_schedule(out, sharing)
        return out

    def _budget(self) -> int:
        cap = self.max_tokens_with_decodes
        if cap is None or cap >= self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        decoding = sum(1 for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens)
        return step_budget(self.max_num_batched_tokens, cap, decoding)

    def _first_prefill_goes_alone(self, busy_tenants: set[str]) -> bool:
        """The next waiting request is the first of a tenant with nothing running, while tenants already running
        here also have requests waiting (the replica is oversubscribed): its prefill runs in a step of its own,
        without the running requests' decodes, as it would on an idle replica. At most one such step in every
        SOLO_STEP_PERIOD, so running requests lose at most that share of their steps however often tenants arrive."""
        if self._steps_since_solo < SOLO_STEP_PERIOD or not self.running:
            return False
        head = self.waiting.peek()
        if head is None or not head.ready or head.tenancy.tenant in busy_tenants \
                or head.timings.first_scheduled is not None:
            return False
        return any(self.waiting.count(tenant) for tenant in busy_tenants)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, now: float, busy_tenants: set[str],
                       protecting: bool) -> None:
        """Admits waiting requests in queue order while the budget, batch slots and blocks last. Once a request
        of a tenant with nothing running (`busy_tenants`: the tenants that had) is admitted, or from the start when
        `protecting`, requests of busy tenants wait for the next step: that request's first token is what fair
        share protects, and their prefills would lengthen its step (other newcomers join it)."""
        deferred: list[Request] = []  # waiting on their grammar: they keep their place, others go meanwhile
        try:
            while budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting.peek()
                if request is None:
                    break
                if not request.ready:
                    self.waiting.remove(request)
                    deferred.append(request)
                    continue
                if protecting and request.tenancy.tenant in busy_tenants:
                    break
                out.considering = request
                hits, num_cached = self.kv.get_computed_blocks(request)
                num_new = min(request.num_tokens - num_cached, budget)
                if not self.kv.allocate_slots(request, num_new, hits):
                    break
                self.waiting.remove(request)
                if busy_tenants and request.tenancy.tenant not in busy_tenants \
                        and request.timings.first_scheduled is None:
                    protecting = True
                self._admit(request, num_cached, now)
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
        finally:
            self.waiting.restore(deferred)

    def _finish_schedule(self, out: SchedulerOutput, sharing: bool) -> None:
        out.considering = None
        if sharing:
            self._charge(out)

    def _admit(self, request: Request, num_cached: int, now: float) -> None:
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        if request.status == RequestStatus.PREEMPTED:
            request.timings.record(EventKind.RESUMED)
        elif request.timings.first_scheduled is None:
            request.timings.first_scheduled = now
            request.timings.record(EventKind.SCHEDULED)
        request.status = RequestStatus.RUNNING
        self._num_admitted += 1
        request.running_order = (request.tenancy.priority, self._num_admitted)
        if not self.running or self.running[-1].running_order < request.running_order:
            self.running.append(request)  # the common case, and the only one while every priority is equal
        else:
            bisect.insort(self.running, request, key=_running_order)

    def _preempt_for_priority(self, now: float, out: SchedulerOutput) -> None:
        """The next waiting request outranks the last running one and lacks blocks or a batch slot: running
        requests of lower priority give them up, lowest and newest first, until it has both."""
        head = self.waiting.peek()
        if head is None or not head.ready or not self.running \
                or head.tenancy.priority >= self.running[-1].tenancy.priority:
            return
        needed = self.kv.blocks_needed(min(head.num_tokens, self.max_num_batched_tokens))
        while self.running and self.running[-1].tenancy.priority > head.tenancy.priority and (
                self.kv.pool.num_free_blocks < needed or len(self.running) >= self.max_num_seqs):
            victim = self.running.pop()
            self._preempt(victim, now)
            out.preempted.append(victim)

    def _preempt_for_fair_share(self, now: float, out: SchedulerOutput) -> None:
        """The next waiting request's tenant has nothing running here and cannot start (slots or blocks taken):
        the most-served tenant running two or more gives up its newest request of no higher priority, so every
        tenant with work holds at least one slot (its blocks stay in the prefix cache for its return)."""
        head = self.waiting.peek()
        if head is None or not head.ready or not self.running:
            return
        needed = self.kv.blocks_needed(min(head.num_tokens, self.max_num_batched_tokens))
        if len(self.running) < self.max_num_seqs and self.kv.pool.num_free_blocks >= needed:
            return
        running: dict[str, int] = {}
        for request in self.running:
            running[request.tenancy.tenant] = running.get(request.tenancy.tenant, 0) + 1
        if head.tenancy.tenant in running:
            return
        crowded = [t for t, n in running.items() if n > 1]
        if not crowded:
            return
        richest = max(crowded, key=self.fair.counter)
        for victim in self.running[::-1]:  # a copy: victims leave the list
            if running[richest] < 2 or (len(self.running) < self.max_num_seqs
                                        and self.kv.pool.num_free_blocks >= needed):
                return
            if victim.tenancy.tenant == richest and victim.tenancy.priority >= head.tenancy.priority:
                self.running.remove(victim)
                self._preempt(victim, now)
                out.preempted.append(victim)
                running[richest] -= 1

    def _charge(self, out: SchedulerOutput) -> None:
        """The step's tokens, to each tenant's virtual token counter."""
        charge = self.fair.charge
        for s in out.scheduled:
            if s.is_decode:
                charge(s.request.tenancy, 0, 1)
            else:
                charge(s.request.tenancy, s.num_new_tokens, 0)

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

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, tuple[int, TokenLogprobs | None]]
                           ) -> list[tuple[Request, int, TokenLogprobs | None]]:
        """After the step ran: moves each scheduled request past the tokens it computed, appends what it sampled
        and finishes those that met a stop. Returns each request that sampled, with its token and logprobs."""
        now = time.time()
        advanced = []
        for s in out.scheduled:
            request = s.request
            if s.is_decode:
                request.timings.num_decode_steps += 1
            else:
                request.timings.record(EventKind.PREFILL_CHUNK, s.num_new_tokens)
            request.num_computed_tokens += s.num_new_tokens
            if request.request_id not in sampled:
                continue
            token, logprobs = sampled[request.request_id]
            request.append_output_token(token)
            if request.grammar is not None:
                request.grammar.accept(token)
            if logprobs is not None:
                request.output_logprobs.append(logprobs)
            if request.timings.first_token is None:
                request.timings.first_token = now
                request.timings.record(EventKind.FIRST_TOKEN)
            request.timings.last_token = now
            status = request.check_stop(self.max_model_len)
            if status is not None:
                self.finish(request, status)
            advanced.append((request, token, logprobs))
        return advanced

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


def _running_order(request: Request) -> tuple[int, int]:
    return request.running_order
