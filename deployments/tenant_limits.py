"""Per-tenant limits at the ingress: requests per minute, tokens per minute, requests at once.

Each per-minute limit is a token bucket holding at most one minute's allowance and refilling continuously, so a
tenant may burst up to its limit and then goes at its rate. Tokens are counted as OpenAI counts them up front: the
prompt's tokens plus `max_tokens` for each choice. Past a limit the answer is 429 (`rate_limit_exceeded`) with
`Retry-After` (the seconds until the request would fit) and OpenAI's `x-ratelimit-*` headers, which every answer
to a limited tenant carries: limit, remaining and reset (time until the bucket is full again) for requests and
for tokens.

Several ingress replicas: each decides from its own buckets and shares them through the app's ledger
(deployments/tenant_ledger.py).
"""
from __future__ import annotations

import contextvars
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from deployments import auth
from deployments.errors import OpenAIError
from deployments.tenants import Tenant, TenantLimits

log = logging.getLogger(__name__)

LIMITED_PATHS = ("/v1/completions", "/v1/chat/completions")
_LEASE: contextvars.ContextVar["Lease | None"] = contextvars.ContextVar("tokenline_tenant_lease", default=None)


@dataclass
class Bucket:
    """A token bucket of one minute's allowance."""

    per_minute: int
    level: float = -1.0  # -1: full, set on first use
    updated: float = 0.0

    def refill(self, now: float) -> None:
        if self.level < 0:
            self.level = float(self.per_minute)
        else:
            self.level = min(self.per_minute, self.level + (now - self.updated) * self.per_minute / 60.0)
        self.updated = now

    def take(self, amount: float, now: float) -> bool:
        self.refill(now)
        if self.level < amount:
            return False
        self.level -= amount
        return True

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` fits (after refill)."""
        return max(amount - self.level, 0.0) * 60.0 / self.per_minute

    def reset_s(self) -> float:
        return self.wait_s(self.per_minute)


@dataclass
class TenantState:
    limits: TenantLimits
    requests: Bucket | None = None
    tokens: Bucket | None = None
    in_flight: int = 0
    others_in_flight: int = 0  # other ingress replicas', as the ledger last said
    taken_requests: int = 0  # since the last sync
    taken_tokens: int = 0

    def __post_init__(self) -> None:
        self.configure(self.limits)

    def configure(self, limits: TenantLimits) -> None:
        """Limits read again from the tenants file: a bucket keeps its level, capped by its new size."""
        self.limits = limits
        self.requests = resized(self.requests, limits.requests_per_minute)
        self.tokens = resized(self.tokens, limits.tokens_per_minute)


def resized(bucket: Bucket | None, per_minute: int | None) -> Bucket | None:
    if per_minute is None:
        return None
    if bucket is None:
        return Bucket(per_minute)
    return Bucket(per_minute, min(bucket.level, per_minute), bucket.updated)


@dataclass
class Lease:
    """One admitted request of a limited tenant: its place among the tenant's requests in flight."""

    limiter: "TenantLimiter"
    tenant: Tenant
    state: TenantState
    released: bool = False

    def take_tokens(self, num_tokens: int) -> None:
        """Counts the request's tokens against tokens per minute, or raises 429."""
        bucket = self.state.tokens
        if bucket is None:
            return
        if num_tokens > bucket.per_minute:
            raise self.limiter.refused(self.tenant, self.state, f"this request counts {num_tokens:,} tokens (prompt "
                                       f"plus max_tokens for each choice), more than tenant {self.tenant.name!r} "
                                       f"may use in a minute ({bucket.per_minute:,}); lower max_tokens or n, or "
                                       f"shorten the prompt", 60.0)
        if not bucket.take(num_tokens, time.monotonic()):
            raise self.limiter.refused(self.tenant, self.state, f"tenant {self.tenant.name!r} is past its limit of "
                                       f"{bucket.per_minute:,} tokens per minute", bucket.wait_s(num_tokens))
        self.state.taken_tokens += num_tokens

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.state.in_flight -= 1


class TenantLimiter:
    """One ingress replica's view of every limited tenant's buckets and requests in flight."""

    def __init__(self) -> None:
        self.states: dict[str, TenantState] = {}

    def admit(self, tenant: Tenant) -> Lease | None:
        """A lease for a request of a limited tenant, None for an unlimited one; raises 429 past a limit."""
        if not tenant.limits.any:
            self.states.pop(tenant.name, None)
            return None
        state = self.states.get(tenant.name)
        if state is None:
            state = self.states[tenant.name] = TenantState(tenant.limits)
        elif state.limits != tenant.limits:
            state.configure(tenant.limits)
        limit = tenant.limits.max_concurrent_requests
        if limit is not None and state.in_flight + state.others_in_flight >= limit:
            raise self.refused(tenant, state, f"tenant {tenant.name!r} has {limit} requests in flight, its limit "
                                              f"of requests at once; retry when one finishes", 1.0)
        if state.requests is not None and not state.requests.take(1, time.monotonic()):
            raise self.refused(tenant, state, f"tenant {tenant.name!r} is past its limit of "
                                              f"{state.requests.per_minute:,} requests per minute",
                               state.requests.wait_s(1))
        state.taken_requests += 1
        state.in_flight += 1
        return Lease(self, tenant, state)

    def refused(self, tenant: Tenant, state: TenantState, message: str, retry_after_s: float) -> OpenAIError:
        headers = {"Retry-After": str(max(1, math.ceil(retry_after_s))), **rate_limit_headers(state)}
        log.info("tenant %s refused: %s", tenant.name, message)
        return OpenAIError(429, message, code="rate_limit_exceeded", headers=headers)

    def usage_report(self) -> dict[str, tuple[int, int, int]]:
        """What this replica took since its last report, per tenant: (requests, tokens, in flight now)."""
        report = {name: (s.taken_requests, s.taken_tokens, s.in_flight) for name, s in self.states.items()}
        for state in self.states.values():
            state.taken_requests = state.taken_tokens = 0
        return report

    def apply(self, answer: dict[str, tuple[float | None, float | None, int]]) -> None:
        """The ledger's answer: each tenant's deployment-wide bucket levels and the others' requests in flight.
        What this replica took since it reported is taken off again: the ledger has not seen it yet."""
        now = time.monotonic()
        for name, (requests, tokens, others) in answer.items():
            state = self.states.get(name)
            if state is None:
                continue
            for bucket, level, taken in ((state.requests, requests, state.taken_requests),
                                         (state.tokens, tokens, state.taken_tokens)):
                if bucket is not None and level is not None:
                    bucket.level, bucket.updated = max(min(level, bucket.per_minute) - taken, 0.0), now
            state.others_in_flight = others


def rate_limit_headers(state: TenantState) -> dict[str, str]:
    headers = {}
    for kind, bucket in (("requests", state.requests), ("tokens", state.tokens)):
        if bucket is not None:
            bucket.refill(time.monotonic())
            headers[f"x-ratelimit-limit-{kind}"] = str(bucket.per_minute)
            headers[f"x-ratelimit-remaining-{kind}"] = str(int(bucket.level))
            headers[f"x-ratelimit-reset-{kind}"] = _duration(bucket.reset_s())
    return headers


def _duration(seconds: float) -> str:
    """OpenAI's form: 1s, 6m0s, 250ms."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, secs = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def current_lease() -> Lease | None:
    """The limited tenant's lease of the request being handled (set by the middleware), if any."""
    return _LEASE.get()


_limiter = TenantLimiter()  # one per ingress process, as the key guard


class TenantLimitsMiddleware:
    """Admits or refuses generation requests of limited tenants before the handler runs; keeps each admitted one
    counted in flight until its response has ended, and puts the `x-ratelimit-*` headers on every answer."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") not in LIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        authorization = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        tenant = auth.tenant_of(authorization)
        if tenant is None or not tenant.limits.any:  # unknown keys get their 401 from the handler
            await self.app(scope, receive, send)
            return
        from deployments.tenant_ledger import ensure_sync  # it imports this module

        ensure_sync(_limiter)
        try:
            lease = _limiter.admit(tenant)
        except OpenAIError as exc:
            response = exc.response()
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": response.raw_headers})
            await send({"type": "http.response.body", "body": response.body, "more_body": False})
            return

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                present = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k.encode(), v.encode()) for k, v in rate_limit_headers(lease.state).items()
                         if k.encode() not in present]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        token = _LEASE.set(lease)
        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            _LEASE.reset(token)
            lease.release()
