"""Whose a request is, and in what order waiting requests are admitted: priority, then fair share, then arrival.

Fair share is the virtual token counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024):
each tenant's counter grows by the tokens the engine computes for it (prompt tokens and output tokens, each
weighted), divided by the tenant's weight; among tenants with work waiting, the one with the smallest counter
is admitted next. A tenant that comes back from idle starts at the smallest counter of those waiting (or where
the last one left off), so idle time banks no credit. One tenant alone (the default) is plain FCFS.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.request import Request


@dataclass(frozen=True)
class Tenancy:
    """What the scheduler and the prefix cache know of a request's owner. `cache_salt`: blocks hash with it, so
    only requests with the same salt share cached blocks (None: shared with every unsalted request)."""

    tenant: str = ""  # the anonymous tenant
    weight: float = 1.0
    priority: int = 0  # lower runs first
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"a tenant's weight must be > 0; got {self.weight}")


DEFAULT_TENANCY = Tenancy()


class FairShare:
    """Weighted virtual token counters, one per tenant seen."""

    def __init__(self, prompt_token_weight: float = 1.0, output_token_weight: float = 2.0) -> None:
        self.prompt_token_weight = prompt_token_weight
        self.output_token_weight = output_token_weight
        self.counters: dict[str, float] = {}
        self._last_left = 0.0  # the counter of the tenant that last stopped having work waiting

    def charge(self, tenancy: Tenancy, num_prompt_tokens: int, num_output_tokens: int) -> None:
        cost = num_prompt_tokens * self.prompt_token_weight + num_output_tokens * self.output_token_weight
        self.counters[tenancy.tenant] = self.counters.get(tenancy.tenant, 0.0) + cost / tenancy.weight

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def arrive(self, tenant: str, backlogged: Iterable[str]) -> None:
        """`tenant` has work waiting again: it starts no lower than the least-served tenant still waiting."""
        floor = min((self.counter(t) for t in backlogged), default=self._last_left)
        self.counters[tenant] = max(self.counter(tenant), floor)

    def leave(self, tenant: str) -> None:
        self._last_left = self.counter(tenant)


class WaitingQueue:
    """Requests not running, by priority, then tenant (least counter first, then least waiting), then arrival.

    With `late_after_s` (half the engine's TTFT objective), a request that has waited that long since it arrived
    without a first token goes behind the requests of its priority that can still meet the objective (`demote_late`,
    each step): under overload a queue in arrival order makes every request behind it late too, while this spends the
    replica's capacity on the ones that can still be on time. Late requests keep their order among themselves and
    run whenever no request on time is waiting (their deadlines still bound them). Facebook's adaptive LIFO serves
    overloaded queues newest first for the same reason; this keeps arrival order among those still on time.

    Choosing the next request costs O(priorities + tenants waiting); one priority and one tenant is a deque."""

    def __init__(self, fair: FairShare, late_after_s: float | None = None) -> None:
        self.fair = fair
        self.late_after_s = late_after_s
        # (priority, late) -> tenant -> requests: late requests form a band just after their priority's
        self._queues: dict[tuple[int, bool], dict[str, deque[Request]]] = {}
        self._per_tenant: dict[str, int] = {}  # requests waiting per tenant, over all priorities
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        for band in sorted(self._queues):
            for queue in self._queues[band].values():
                yield from queue

    @property
    def num_late(self) -> int:
        """Requests in the late bands: waiting past half their TTFT objective with no first token."""
        return sum(len(q) for band, tenants in self._queues.items() if band[1] for q in tenants.values())

    def count(self, tenant: str) -> int:
        """Requests of `tenant` waiting (read from other threads too: one dict lookup)."""
        return self._per_tenant.get(tenant, 0)

    def append(self, request: Request) -> None:
        self._queue_for(request, arriving=True).append(request)

    def appendleft(self, request: Request) -> None:
        """A preempted request goes back to the head of its own tenant's queue."""
        self._queue_for(request, arriving=True).appendleft(request)

    def restore(self, requests: list[Request]) -> None:
        """Puts back at their heads, in order, requests taken off this step without being admitted."""
        for request in reversed(requests):
            self._queue_for(request, arriving=False).appendleft(request)

    def demote_late(self, now: float) -> int:
        """Moves the requests that have waited `late_after_s` since arrival with no first token into their
        priority's late band, in arrival order; returns how many moved. Each tenant's queue is in arrival order
        after the preempted requests at its head, so the scan stops at the first request still on time."""
        if self.late_after_s is None:
            return 0
        cutoff = now - self.late_after_s
        moved = 0
        for key in [k for k in self._queues if not k[1]]:
            for tenant, queue in list(self._queues[key].items()):
                late = []
                for request in queue:
                    if request.num_output_tokens:
                        continue  # it had its first token before it was preempted: never late
                    if request.timings.arrival > cutoff:
                        break
                    late.append(request)
                if not late:
                    continue
                for request in late:
                    self.remove(request, leaving=False)
                    request.late = True
                    self._queue_for(request, arriving=False).append(request)
                moved += len(late)
        return moved

    def peek(self) -> Request | None:
        """The request to admit next."""
        if not self._len:
            return None
        tenants = self._queues[min(self._queues)]
        if len(tenants) == 1:
            return next(iter(tenants.values()))[0]
        counter, waiting = self.fair.counter, self._per_tenant
        # Equal counters (a tenant lifted to the others' level on arrival): the one with less waiting goes first.
        return tenants[min(tenants, key=lambda t: (counter(t), waiting[t]))][0]

    def remove(self, request: Request, leaving: bool = True) -> None:
        """Takes `request` off the queue (`leaving=False`: only to put it back in another band)."""
        tenancy = request.tenancy
        key = (tenancy.priority, request.late)
        tenants = self._queues[key]
        queue = tenants[tenancy.tenant]
        if queue[0] is request:
            queue.popleft()
        else:
            queue.remove(request)
        if not queue:
            del tenants[tenancy.tenant]
            if not tenants:
                del self._queues[key]
        self._len -= 1
        left = self._per_tenant[tenancy.tenant] - 1
        if left:
            self._per_tenant[tenancy.tenant] = left
        else:
            del self._per_tenant[tenancy.tenant]
            if leaving:
                self.fair.leave(tenancy.tenant)
        if leaving:
            request.late = False  # admitted (or finished): if it comes back, its lateness is read again

    def _queue_for(self, request: Request, arriving: bool) -> deque[Request]:
        tenancy = request.tenancy
        count = self._per_tenant.get(tenancy.tenant, 0)
        if not count and arriving:
            self.fair.arrive(tenancy.tenant, self._per_tenant)
        self._per_tenant[tenancy.tenant] = count + 1
        self._len += 1
        tenants = self._queues.setdefault((tenancy.priority, request.late), {})
        queue = tenants.get(tenancy.tenant)
        if queue is None:
            queue = tenants[tenancy.tenant] = deque()
        return queue
