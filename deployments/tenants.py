"""Tenants: who an API key belongs to, and what that tenant may have (weight, priorities, cache isolation, limits).

A tenants file (`security.tenants_file`, YAML) names each tenant and its keys, as plain keys (`keys`) or as
SHA-256 hex digests (`key_sha256`, so the file need not hold secrets); only digests are kept in memory. It is read
again when it changes; one that cannot be read or does not validate closes the API (no key matches) until it is
fixed, as key files do. Keys given only as a list (`TOKENLINE_API_KEYS`, `security.api_keys_file`) are one tenant
each, named by position (`key-1`, `key-2`, ... over the variable, then the file); the admin key is the tenant
`admin`. With no key at all, every request is the one `anonymous` tenant: no salt, no cap, no limits.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.tenancy import Tenancy

SALT_SEPARATOR = "\x1f"  # never in a tenant's name, so no cache_salt makes one tenant's salt equal another's
ANONYMOUS = "anonymous"
ADMIN = "admin"


class TenantLimits(BaseModel):
    """Per-tenant limits, counted at the ingress (deployments/tenant_limits.py); None: no limit."""

    model_config = ConfigDict(extra="forbid")

    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1, description="prompt tokens plus max_tokens, as OpenAI counts")
    max_concurrent_requests: int | None = Field(None, ge=1)

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.requests_per_minute, self.tokens_per_minute,
                                           self.max_concurrent_requests))


class TenantSpec(BaseModel):
    """One tenant of the tenants file."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    weight: float = Field(1.0, gt=0, le=1e6, description="its share of a busy replica, relative to the others")
    default_priority: int = Field(0, ge=-1_000_000, le=1_000_000, description="priority of a request that sets none")
    max_priority: int = Field(0, ge=-1_000_000, le=1_000_000, description="the most urgent priority it may ask "
                                                                          "for (lower runs first)")
    isolate_cache: bool = Field(True, description="its prefix-cache blocks are its own (a per-tenant salt)")
    limits: TenantLimits = Field(default_factory=TenantLimits)
    keys: list[str] = Field(default_factory=list)
    key_sha256: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> "TenantSpec":
        if self.default_priority < self.max_priority:
            raise ValueError(f"tenant {self.name}: default_priority {self.default_priority} is more urgent than "
                             f"its max_priority {self.max_priority}")
        for digest in self.key_sha256:
            if len(digest) != 64 or any(c not in "0123456789abcdefABCDEF" for c in digest):
                raise ValueError(f"tenant {self.name}: key_sha256 entries are 64 hex digits")
        return self


class TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: list[TenantSpec]

    @model_validator(mode="after")
    def _unique(self) -> "TenantsFile":
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError("tenant names must be unique")
        return self


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0
    default_priority: int = 0
    max_priority: int | None = 0  # None: any priority may be asked for
    cache_salt: str | None = None  # None: shares the prefix cache with every unsalted request
    limits: TenantLimits = field(default_factory=TenantLimits)

    def priority(self, requested: int | None) -> int:
        """The request's priority: the tenant's default when it sets none, never more urgent than its cap."""
        priority = self.default_priority if requested is None else requested
        return priority if self.max_priority is None else max(priority, self.max_priority)

    def tenancy(self, requested_priority: int | None, cache_salt: str | None) -> Tenancy:
        """What the engine knows of the request: a request's own `cache_salt` narrows the tenant's further."""
        salt = None
        if self.cache_salt is not None or cache_salt is not None:
            salt = f"{self.cache_salt or ''}{SALT_SEPARATOR}{cache_salt or ''}"
        return Tenancy(self.name, self.weight, self.priority(requested_priority), salt)

    @classmethod
    def from_spec(cls, spec: TenantSpec) -> "Tenant":
        return cls(spec.name, spec.weight, spec.default_priority, spec.max_priority,
                   spec.name if spec.isolate_cache else None, spec.limits)

    @classmethod
    def by_position(cls, name: str) -> "Tenant":
        """A key given only as a list: a tenant of its own, isolated, at priority 0 at best."""
        return cls(name, cache_salt=name)


ANONYMOUS_TENANT = Tenant(ANONYMOUS, max_priority=None)


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class TenantsFileError(ValueError):
    """The tenants file does not hold a valid set of tenants; the message names what to fix, never a key."""


def parse_tenants(text: str) -> list[tuple[bytes, Tenant]]:
    """(key digest, tenant) for every key of a tenants file's text."""
    try:
        data = yaml.safe_load(text)
        parsed = TenantsFile.model_validate(data)
    except yaml.YAMLError as exc:
        raise TenantsFileError(f"not valid YAML (line {getattr(getattr(exc, 'problem_mark', None), 'line', '?')})") \
            from None
    except ValidationError as exc:  # the messages, never the input: it may hold keys
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise TenantsFileError(problems) from None
    out: list[tuple[bytes, Tenant]] = []
    for spec in parsed.tenants:
        tenant = Tenant.from_spec(spec)
        out += [(digest(k.strip()), tenant) for k in spec.keys if k.strip()]
        out += [(bytes.fromhex(d), tenant) for d in spec.key_sha256]
    if len({d for d, _ in out}) != len(out):
        raise TenantsFileError("a key belongs to more than one tenant")
    if not out:
        raise TenantsFileError("no tenant has a key")
    return out
