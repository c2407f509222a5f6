"""Per-tenant limits across several ingress replicas: one ledger actor per app holds the deployment-wide buckets.

Each ingress replica decides from its own buckets (deployments/tenant_limits.py) and every SYNC_INTERVAL_S
reports what it admitted since its last report, and its requests in flight, to the ledger, which answers with the
deployment-wide bucket levels and the other replicas' requests in flight. So the limits hold for the deployment as
a whole, give or take what the other replicas admit within one interval. A replica silent for STALE_REPORT_S no
longer counts; a ledger that goes away is made again on the next report (its buckets start full).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from deployments.tenant_limits import Bucket, TenantLimiter, resized
from deployments.tenants import TenantLimits

log = logging.getLogger(__name__)

LEDGER_NAME = "tokenline-tenant-ledger"
LEDGER_NAMESPACE = "serve"  # named, not the job's: every ingress replica of the app finds the same one
SYNC_INTERVAL_S = 1.0
STALE_REPORT_S = 5 * SYNC_INTERVAL_S


class TenantLedger:
    """The deployment-wide buckets, fed by every ingress replica's reports (a Ray actor in the app)."""

    def __init__(self) -> None:
        self.requests: dict[str, Bucket] = {}
        self.tokens: dict[str, Bucket] = {}
        self.in_flight: dict[str, dict[str, tuple[int, float]]] = {}  # tenant -> replica -> (in flight, when)

    def report(self, replica: str, limits: dict[str, TenantLimits],
               usage: dict[str, tuple[int, int, int]]) -> dict[str, tuple[float | None, float | None, int]]:
        now = time.monotonic()
        answer = {}
        for name, (taken_requests, taken_tokens, in_flight) in usage.items():
            tenant_limits = limits[name]
            requests = self._bucket(self.requests, name, tenant_limits.requests_per_minute, now)
            tokens = self._bucket(self.tokens, name, tenant_limits.tokens_per_minute, now)
            if requests is not None:
                requests.level = max(requests.level - taken_requests, 0.0)
            if tokens is not None:
                tokens.level = max(tokens.level - taken_tokens, 0.0)
            flights = self.in_flight.setdefault(name, {})
            flights[replica] = (in_flight, now)
            # A replica silent for a few rounds is gone (stopped or dead): its requests in flight no longer count.
            others = sum(n for r, (n, at) in flights.items() if r != replica and now - at < STALE_REPORT_S)
            answer[name] = (requests.level if requests else None, tokens.level if tokens else None, others)
        return answer

    @staticmethod
    def _bucket(buckets: dict[str, Bucket], name: str, per_minute: int | None, now: float) -> Bucket | None:
        if per_minute is None:
            buckets.pop(name, None)
            return None
        bucket = buckets.get(name)
        if bucket is None or bucket.per_minute != per_minute:
            bucket = buckets[name] = resized(bucket, per_minute)
        bucket.refill(now)
        return bucket


@dataclass
class _Shared:
    replica: str = ""
    sync_task: asyncio.Task | None = None


_shared = _Shared()


def ensure_sync(limiter: TenantLimiter) -> None:
    """Inside a Serve replica, starts reporting `limiter`'s usage to the app's ledger once; elsewhere limits stay
    local."""
    if _shared.sync_task is not None and not _shared.sync_task.done():
        return
    try:
        from ray import serve

        context = serve.get_replica_context()
    except Exception:  # not inside Serve
        return
    _shared.replica = context.replica_id.unique_id
    _shared.sync_task = asyncio.get_running_loop().create_task(
        _sync_forever(limiter, f"{LEDGER_NAME}-{context.app_name}", SYNC_INTERVAL_S))


async def _sync_forever(limiter: TenantLimiter, name: str, interval_s: float) -> None:
    import ray

    ledger = None
    while True:
        await asyncio.sleep(interval_s)
        states = limiter.states
        if not states:
            continue
        try:
            if ledger is None:
                # Owned by the replica that made it: it goes with the app; if that replica goes first, the
                # next report makes a new one (buckets start full again).
                ledger = ray.remote(TenantLedger).options(name=name, namespace=LEDGER_NAMESPACE, get_if_exists=True,
                                                          num_cpus=0).remote()
            limits = {name: s.limits for name, s in states.items()}
            usage = limiter.usage_report()
            answer = await ledger.report.remote(_shared.replica, limits, usage)
            limiter.apply(answer)
        except Exception as exc:  # the ledger restarts on the next round; limits stay local meanwhile
            log.warning("tenant limits: the ledger did not answer (%r); limits are this replica's own until it does",
                        exc)
            ledger = None
