"""Tenants on their own: which tenant a key is (tenants file, keys by position, none at all), what a tenant may
ask for, and the per-tenant limits' buckets, shared by several ingress replicas through the ledger."""
from __future__ import annotations

import hashlib
import os

import pytest
from starlette.requests import Request

from deployments.auth import KeyGuard, SecurityArgs
from deployments.errors import OpenAIError
from deployments.tenant_ledger import TenantLedger
from deployments.tenant_limits import TenantLimiter
from deployments.tenants import ANONYMOUS_TENANT, Tenant, TenantLimits

TENANTS = """
tenants:
  - name: team-a
    weight: 3
    default_priority: 5
    max_priority: 1
    limits: {requests_per_minute: 2}
    keys: [sk-a-1, sk-a-2]
  - name: team-b
    isolate_cache: false
    key_sha256: [%s]
""" % hashlib.sha256(b"sk-b-1").hexdigest()


def request(key: str | None = None) -> Request:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key is not None else []
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers})


def tenant_or_status(guard: KeyGuard, key: str | None) -> Tenant | int:
    try:
        return guard.check_api(request(key))
    except OpenAIError as exc:
        return exc.status


def write(path, text: str) -> None:
    fresh = path.with_name(path.name + ".new")
    fresh.write_text(text)
    os.replace(fresh, path)


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv("TOKENLINE_TEST_KEYS", raising=False)
    monkeypatch.delenv("TOKENLINE_TEST_ADMIN_KEY", raising=False)
    return monkeypatch


def guard(tenants_file=None, api_file=None) -> KeyGuard:
    return KeyGuard(SecurityArgs(api_keys_env="TOKENLINE_TEST_KEYS", admin_key_env="TOKENLINE_TEST_ADMIN_KEY",
                                 tenants_file=tenants_file and str(tenants_file),
                                 api_keys_file=api_file and str(api_file)))


def test_no_keys_is_one_anonymous_tenant_that_changes_nothing(env):
    tenant = tenant_or_status(guard(), None)
    assert tenant == ANONYMOUS_TENANT
    tenancy = tenant.tenancy(None, None)
    assert (tenancy.tenant, tenancy.priority, tenancy.cache_salt, tenancy.weight) == ("anonymous", 0, None, 1.0)
    assert tenant.tenancy(-7, None).priority == -7  # no cap, as vLLM
    assert not tenant.limits.any


def test_keys_given_only_as_a_list_are_one_isolated_tenant_each_named_by_position(env, tmp_path):
    env.setenv("TOKENLINE_TEST_KEYS", "sk-one,sk-two")
    api_file = tmp_path / "keys"
    api_file.write_text("sk-three\n")
    keys = guard(api_file=api_file)
    names = [tenant_or_status(keys, k).name for k in ("sk-one", "sk-two", "sk-three")]
    assert names == ["key-1", "key-2", "key-3"]
    salts = {tenant_or_status(keys, k).tenancy(None, None).cache_salt for k in ("sk-one", "sk-two")}
    assert len(salts) == 2 and None not in salts
    assert tenant_or_status(keys, "sk-one").tenancy(-3, None).priority == 0  # may not jump the queue
    assert tenant_or_status(keys, "sk-four") == 401


def test_tenants_file_maps_keys_to_tenants_and_is_read_again_when_it_changes(env, tmp_path):
    path = tmp_path / "tenants.yaml"
    write(path, TENANTS)
    keys = guard(tenants_file=path)
    a1, a2, b = (tenant_or_status(keys, k) for k in ("sk-a-1", "sk-a-2", "sk-b-1"))
    assert a1 == a2 and a1.name == "team-a" and b.name == "team-b"
    assert a1.weight == 3 and a1.limits.requests_per_minute == 2
    assert a1.tenancy(None, None).priority == 5 and a1.tenancy(-10, None).priority == 1
    assert a1.tenancy(None, None).cache_salt != a1.tenancy(None, "x").cache_salt  # a request's salt narrows it
    assert b.tenancy(None, None).cache_salt is None  # shares the cache
    assert tenant_or_status(keys, "sk-nobody") == 401
    write(path, TENANTS.replace("sk-a-2", "sk-a-3"))
    assert tenant_or_status(keys, "sk-a-2") == 401
    assert tenant_or_status(keys, "sk-a-3").name == "team-a"


@pytest.mark.parametrize("text", ["tenants: [{name: x}]", "tenants: [{name: 'bad name', keys: [k]}]",
                                  "tenants: [{name: x, keys: [k]}, {name: y, keys: [k]}]", "{not yaml",
                                  "tenants: [{name: x, keys: [k], default_priority: -1, max_priority: 0}]"],
                         ids=["no-key", "bad-name", "shared-key", "not-yaml", "default-above-cap"])
def test_invalid_tenants_file_closes_the_api_without_logging_a_key(env, tmp_path, text, caplog):
    path = tmp_path / "tenants.yaml"
    write(path, text)
    assert tenant_or_status(guard(tenants_file=path), "k") == 401
    assert "is not valid" in caplog.text or "holds no key" in caplog.text
    assert "'k'" not in caplog.text


def limited(**limits) -> Tenant:
    return Tenant("t", limits=TenantLimits(**limits))


def refusal(fn, *args) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        fn(*args)
    assert info.value.status == 429 and info.value.body.error.code == "rate_limit_exceeded"
    assert int(info.value.headers["Retry-After"]) >= 1
    return info.value


def test_requests_per_minute_refuse_past_the_limit_with_retry_after_and_headers():
    limiter, tenant = TenantLimiter(), limited(requests_per_minute=3)
    for _ in range(3):
        limiter.admit(tenant).release()
    error = refusal(limiter.admit, tenant)
    assert error.headers["x-ratelimit-limit-requests"] == "3"
    assert error.headers["x-ratelimit-remaining-requests"] == "0"
    assert error.headers["x-ratelimit-reset-requests"].endswith("s")
    assert 1 <= int(error.headers["Retry-After"]) <= 20  # one request refills in 20 s


def test_tokens_per_minute_count_prompt_and_max_tokens():
    limiter, tenant = TenantLimiter(), limited(tokens_per_minute=100)
    lease = limiter.admit(tenant)
    lease.take_tokens(60)
    error = refusal(lease.take_tokens, 60)
    assert error.headers["x-ratelimit-remaining-tokens"] == "40"
    assert "tokens per minute" in error.body.error.message
    assert "more than tenant" in refusal(lease.take_tokens, 101).body.error.message


def test_concurrent_requests_refuse_past_the_limit_and_admit_once_one_ends():
    limiter, tenant = TenantLimiter(), limited(max_concurrent_requests=2)
    first, _ = limiter.admit(tenant), limiter.admit(tenant)
    refusal(limiter.admit, tenant)
    first.release()
    first.release()  # a second release counts once
    assert limiter.admit(tenant) is not None
    refusal(limiter.admit, tenant)


def test_unlimited_tenant_is_never_refused():
    limiter = TenantLimiter()
    assert all(limiter.admit(Tenant("free")) is None for _ in range(1000))


def test_two_ingress_replicas_share_one_limit_through_the_ledger():
    ledger, tenant = TenantLedger(), limited(requests_per_minute=10, max_concurrent_requests=4)
    one, two = TenantLimiter(), TenantLimiter()

    def sync(name: str, limiter: TenantLimiter) -> None:
        limits = {n: s.limits for n, s in limiter.states.items()}
        limiter.apply(ledger.report(name, limits, limiter.usage_report()))

    held = [one.admit(tenant) for _ in range(3)]  # in flight on replica one
    sync("one", one)
    kept = two.admit(tenant)  # two had not seen the tenant: it learns of one's at its first report
    sync("two", two)
    refusal(two.admit, tenant)  # 3 on one + 1 here: the limit of 4 at once, deployment-wide
    for lease in [*held, kept]:
        lease.release()
    sync("one", one)
    sync("two", two)
    for _ in range(6):  # 10 a minute in all: one took 3, two 1, so 6 are left
        two.admit(tenant).release()
    refusal(two.admit, tenant)
    sync("two", two)
    sync("one", one)
    error = refusal(one.admit, tenant)  # one never admitted these, but the ledger told it
    assert error.headers["x-ratelimit-remaining-requests"] == "0"
