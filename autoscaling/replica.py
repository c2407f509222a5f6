"""One simulated engine replica: the engine's scheduler, roughly, with steps timed by a fitted StepTimeModel.

It schedules as engine/scheduler.py does: running requests first under one token budget (decodes, continuing
prefill chunks), then waiting ones in order while budget, KV blocks and `max_num_seqs` allow (with a TTFT
objective, those still able to meet it before those that waited past half of it with no first token); when blocks
run out the newest running request is preempted, loses its KV and goes back to the head of the queue. A prefix cache of
prompt block ids (LRU, the pool's size) spares a returning prefix its prefill. Not modelled: block sharing between
running requests with one prefix, and eviction of cached blocks by running ones.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from autoscaling.capacity import StepStats
from autoscaling.replica_load import ReplicaLoad
from autoscaling.signals import ReplicaSignals, replica_signals
from autoscaling.step_model import EngineShape, StepTimeModel
from autoscaling.workload import RequestSpec

LATE_SHARE = 0.5  # engine.scheduler.LATE_SHARE: past this share of the TTFT objective a waiting request is late
PREEMPTION_WINDOW_S = 10.0  # the replica reports preemptions per second over this window


@dataclass(eq=False)
class SimRequest:
    """A request's progress, as the engine's Request keeps it (`num_computed_tokens`), and its timings."""

    index: int
    spec: RequestSpec
    computed: int = 0
    output_done: int = 0
    blocks: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish_s: float | None = None
    failed: str | None = None  # why it did not finish: "killed" (drain timeout), "too_long", "unfinished"

    @property
    def num_tokens(self) -> int:
        return self.spec.prompt_tokens + self.output_done

    @property
    def finished(self) -> bool:
        return self.finish_s is not None or self.failed is not None


@dataclass
class ScheduledStep:
    batch: list[tuple[SimRequest, int]] = field(default_factory=list)
    stats: StepStats | None = None

    @property
    def seconds(self) -> float:
        return self.stats.duration_s if self.stats else 0.0


class SimReplica:
    def __init__(self, replica_id: int, engine: EngineShape, step_model: StepTimeModel, started_at: float,
                 ready_at: float, prefix_cache: bool = True, load: ReplicaLoad | None = None,
                 ttft_objective_s: float | None = None) -> None:
        self.replica_id = replica_id
        self.engine = engine
        self.step_model = step_model
        self.started_at = started_at
        self.ready_at = ready_at
        self.stopped_at: float | None = None
        self.state = "starting"  # starting -> running -> draining -> stopped
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.free_blocks = engine.num_kv_blocks
        self.step: ScheduledStep | None = None
        self.preemption_times: deque[float] = deque()
        self.prefix_cache = prefix_cache
        self._cache: OrderedDict[int, None] = OrderedDict()
        self.load = load  # the capacity and offered load it reports, as the engine replica does
        self.ttft_objective_s = ttft_objective_s

    @property
    def num_ongoing(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.engine.num_kv_blocks

    def fits(self, request: SimRequest) -> bool:
        spec = request.spec
        return self._blocks(spec.prompt_tokens + spec.output_tokens) <= self.engine.num_kv_blocks

    def add(self, request: SimRequest, now: float) -> None:
        self.waiting.append(request)
        if self.load is not None:
            spec = request.spec
            self.load.arrived(now, spec.prompt_tokens, spec.max_tokens if spec.max_tokens is not None else 1 << 30)

    def signals(self, now: float) -> ReplicaSignals:
        while self.preemption_times and self.preemption_times[0] < now - PREEMPTION_WINDOW_S:
            self.preemption_times.popleft()
        metrics = {"kv_usage": self.kv_usage, "num_waiting": len(self.waiting), "num_running": len(self.running),
                   "preemptions_per_s": len(self.preemption_times) / PREEMPTION_WINDOW_S}
        if self.load is not None:
            metrics.update(self.load.metrics(now))
        return replica_signals(metrics)

    def start_step(self, now: float, slowdown: float = 1.0) -> ScheduledStep | None:
        """Schedules the next step (None when there is nothing to run); its tokens land at now + step.seconds,
        `slowdown` times the step model's time."""
        step = ScheduledStep()
        budget = self.engine.budget(sum(1 for r in self.running if r.computed >= r.spec.prompt_tokens))
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.computed, budget)
            while self._blocks(request.computed + num_new) - request.blocks > self.free_blocks:
                victim = self.running.pop()  # the newest; never one already scheduled this step
                self._preempt(victim, now)
                preempted = True
                if victim is request:
                    break
            else:
                self._allocate(request, request.computed + num_new)
                step.batch.append((request, num_new))
                budget -= num_new
                i += 1
        while self.waiting and budget > 0 and len(self.running) < self.engine.max_num_seqs and not preempted:
            index = self._next_waiting(now)
            request = self.waiting[index]
            cached = self._cached_prefix(request)
            num_new = min(request.num_tokens - cached, budget)
            if self._blocks(cached + num_new) > self.free_blocks:
                break
            del self.waiting[index]
            request.computed = cached
            request.cached_tokens = request.cached_tokens or cached
            self._allocate(request, cached + num_new)
            self.running.append(request)
            step.batch.append((request, num_new))
            budget -= num_new
        if not step.batch:
            return None
        step.stats = self._stats(step, now, slowdown)
        self.step = step
        return step

    def _next_waiting(self, now: float) -> int:
        """The waiting request to admit next: the first, or with a TTFT objective the first that had its first
        token or has waited less than half the objective (the engine's late band: engine.tenancy.WaitingQueue,
        engine.scheduler.LATE_SHARE, restated: the autoscaling package does not import the engine)."""
        if self.ttft_objective_s is None:
            return 0
        cutoff = now - self.ttft_objective_s * LATE_SHARE
        for index, request in enumerate(self.waiting):
            if request.output_done or request.spec.arrival_s > cutoff:
                return index
        return 0

    def finish_step(self, now: float) -> list[SimRequest]:
        """Applies the running step's tokens at `now`; returns the requests that finished."""
        step, self.step = self.step, None
        if step is not None and self.load is not None:
            self.load.steps.add(step.stats)
        finished = []
        for request, num_new in step.batch if step else []:
            request.computed += num_new
            if request.computed - num_new < request.spec.prompt_tokens <= request.computed:
                self._remember(request.spec)  # the prompt's blocks are full and hashed: cached from now on
            if request.computed < request.num_tokens:
                continue  # mid-prefill: no token this step
            request.output_done += 1
            request.first_token_s = request.first_token_s if request.first_token_s is not None else now
            request.last_token_s = now
            if request.output_done >= request.spec.output_tokens:
                request.finish_s = now
                self.running.remove(request)
                self.free_blocks += request.blocks
                request.blocks = 0
                finished.append(request)
                if self.load is not None:
                    self.load.finished(request.spec.prompt_tokens, request.cached_tokens, request.output_done)
        return finished

    def kill(self, now: float) -> list[SimRequest]:
        """Stops the replica: whatever it still holds fails (Serve's graceful shutdown ran out)."""
        lost = self.running + list(self.waiting)
        for request in lost:
            request.failed = "killed"
        self.running, self.waiting, self.step = [], deque(), None
        self.state, self.stopped_at = "stopped", now
        return lost

    def _stats(self, step: ScheduledStep, now: float, slowdown: float) -> StepStats:
        prefill = decodes = context = 0
        attention = 0.0
        for request, num_new in step.batch:
            if num_new == 1 and request.computed >= request.spec.prompt_tokens:  # engine ScheduledRequest.is_decode
                decodes += 1
                context += request.computed + 1
            else:
                prefill += num_new
                attention += num_new * (request.computed + num_new / 2) / 1e6
        seconds = slowdown * self.step_model.seconds(prefill, decodes, context, attention)
        return StepStats(now, seconds, prefill, decodes, context, attention)

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.engine.block_size)

    def _allocate(self, request: SimRequest, num_tokens: int) -> None:
        needed = self._blocks(num_tokens) - request.blocks
        if needed > 0:
            self.free_blocks -= needed
            request.blocks += needed

    def _preempt(self, request: SimRequest, now: float) -> None:
        self.free_blocks += request.blocks
        request.blocks = 0
        request.computed = 0
        request.preemptions += 1
        self.preemption_times.append(now)
        self.waiting.appendleft(request)

    def _cached_prefix(self, request: SimRequest) -> int:
        """Prompt tokens the prefix cache serves, in whole engine blocks; the last token is always recomputed."""
        spec = request.spec
        if not (self.prefix_cache and spec.prefix_ids and spec.tokens_per_prefix_id):
            return 0
        usable = (request.num_tokens - 1) // spec.tokens_per_prefix_id
        hits = 0
        for prefix_id in spec.prefix_ids[:usable]:
            if prefix_id not in self._cache:
                break
            self._cache.move_to_end(prefix_id)
            hits += 1
        tokens = hits * spec.tokens_per_prefix_id
        return tokens - tokens % self.engine.block_size

    def _remember(self, spec: RequestSpec) -> None:
        if not (self.prefix_cache and spec.prefix_ids and spec.tokens_per_prefix_id):
            return
        for prefix_id in spec.prefix_ids:
            self._cache[prefix_id] = None
            self._cache.move_to_end(prefix_id)
        capacity = self.engine.num_kv_blocks * self.engine.block_size // spec.tokens_per_prefix_id
        while len(self._cache) > capacity:
            self._cache.popitem(last=False)
