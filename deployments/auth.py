"""Bearer keys for the HTTP API: `require_api_key` guards /v1/*, `require_admin_key` the profiler and timelines.

Keys come from the environment (`TOKENLINE_API_KEYS`, comma-separated; `TOKENLINE_ADMIN_KEY`) or from files
named in `AppArgs.security` (one key a line, `#` comments), never from the args themselves: the args are shown
by Serve's dashboard and logs. A file is read again when it changes, so keys rotate without a redeploy (write
a new file and rename it over the old one). A configured file that holds no key, or cannot be read, closes what
it guards (no key matches) until it holds keys again: fail closed, also mid-rotation. Neither keys nor prompts
and outputs are ever logged.
Only SHA-256 digests of the keys are kept, and a presented key is compared with every one in constant time.

The rule for admin endpoints:
- an admin key is configured: only that key opens them;
- no admin key, API keys on: they are closed (403), since any API-key holder could otherwise profile the server;
- no keys at all: they are open, like the rest of the API (a development server on loopback).
The admin key also opens /v1/*.
"""
from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from deployments.errors import OpenAIError
from deployments.tenants import ADMIN, ANONYMOUS_TENANT, Tenant, TenantsFileError, digest, parse_tenants

log = logging.getLogger(__name__)

API_KEYS_ENV = "TOKENLINE_API_KEYS"
ADMIN_KEY_ENV = "TOKENLINE_ADMIN_KEY"


class SecurityArgs(BaseModel):
    """Where keys come from, never the keys themselves."""

    model_config = ConfigDict(extra="forbid")

    api_keys_env: str = Field(API_KEYS_ENV, description="env var with comma-separated API keys")
    api_keys_file: str | None = Field(None, description="file with one API key a line; read again when it changes")
    admin_key_env: str = Field(ADMIN_KEY_ENV, description="env var with the admin key")
    admin_key_file: str | None = Field(None, description="file holding the admin key")
    tenants_file: str | None = Field(None, description="YAML file of tenants and their keys (see Tenants); read "
                                                       "again when it changes")


_NOBODY: tuple = ((bytes(32), None),)  # no key hashes to 32 zero bytes


def _parse_keys(text: str, separator: str | None) -> tuple[bytes, ...]:
    """Digests in the order given (a key's position names its tenant), each once."""
    lines = text.split(separator) if separator else text.splitlines()
    return tuple(dict.fromkeys(digest(k) for line in lines if (k := line.strip()) and not k.startswith("#")))


@dataclass
class _WatchedFile:
    """A file parsed again whenever its (mtime, size) changes. One that cannot be read, parses to nothing or fails
    to parse yields `_NOBODY` until it is fixed: a configured file never opens the server, also mid-rewrite."""

    path: Path
    parse: Callable[[str], tuple]
    what: str
    _stamp: tuple[int, int] | None = None
    _value: tuple = ()

    def read(self) -> tuple:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    value, problem = self.parse(self.path.read_text()), "holds no key"
                except TenantsFileError as exc:
                    value, problem = (), f"is not valid ({exc})"
                if value:
                    self._value = value
                    log.info("read %d key(s) from %s %s", len(value), self.what, self.path)
                else:  # emptied, broken, or caught mid-rewrite
                    self._value = _NOBODY
                    log.error("%s %s %s: every key is refused until it is fixed", self.what, self.path, problem)
        except (OSError, UnicodeDecodeError) as exc:
            if self._value is not _NOBODY:
                log.error("%s %s cannot be read (%s): every key is refused", self.what, self.path,
                          getattr(exc, "strerror", None) or type(exc).__name__)
            self._stamp, self._value = None, _NOBODY
        return self._value


@dataclass
class _KeySource:
    """One env var and/or one key file."""

    env: str
    path: Path | None
    _file: _WatchedFile | None = None

    def __post_init__(self) -> None:
        if self.path is not None:
            self._file = _WatchedFile(self.path, lambda text: tuple((d, None) for d in _parse_keys(text, None)),
                                      "key file")

    def digests(self) -> tuple[bytes, ...]:
        keys = _parse_keys(os.environ.get(self.env, ""), ",")
        if self._file is None:
            return keys
        return tuple(dict.fromkeys(keys + tuple(d for d, _ in self._file.read())))


class KeyGuard:
    """Checks bearer keys against the configured API keys, tenants and admin key; says whose a key is."""

    def __init__(self, security: SecurityArgs) -> None:
        self._api = _KeySource(security.api_keys_env, _path(security.api_keys_file))
        self._admin = _KeySource(security.admin_key_env, _path(security.admin_key_file))
        tenants_path = _path(security.tenants_file)
        self._tenants = _WatchedFile(tenants_path, lambda text: tuple(parse_tenants(text)), "tenants file") \
            if tenants_path else None

    def tenants(self) -> tuple[tuple[bytes, Tenant | None], ...]:
        """(key digest, tenant) for every key that opens /v1/*; empty when no key is configured at all."""
        entries = list(self._tenants.read()) if self._tenants else []
        known = {d for d, _ in entries}
        entries += [(d, _unless_nobody(d, Tenant.by_position(f"key-{i}")))
                    for i, d in enumerate(self._api.digests(), 1) if d not in known]
        entries += [(d, _unless_nobody(d, ADMIN_TENANT)) for d in self._admin.digests()]
        return tuple(entries)

    def check_api(self, request: Request) -> Tenant:
        entries = self.tenants()
        if not entries:
            return ANONYMOUS_TENANT
        return _match_or_401(request, entries)

    def tenant_of(self, authorization: str) -> Tenant | None:
        """The tenant an Authorization header names, or None for a missing or unknown key (never raises)."""
        entries = self.tenants()
        if not entries:
            return ANONYMOUS_TENANT
        return _match(_presented(authorization), entries)

    def check_admin(self, request: Request) -> None:
        admin = self._admin.digests()
        if admin:
            _match_or_401(request, tuple((d, ADMIN_TENANT) for d in admin))
        elif self.tenants():
            raise OpenAIError(403, f"admin endpoints are closed: API keys are on and no admin key is configured "
                                   f"(set {self._admin.env} or security.admin_key_file)",
                              code="admin_key_not_configured", type="permission_error")


ADMIN_TENANT = Tenant(ADMIN, max_priority=None, cache_salt=ADMIN)


def _unless_nobody(key_digest: bytes, tenant: Tenant) -> Tenant | None:
    """A file that failed closed stands in the list as a digest no key has, and opens for no one."""
    return None if key_digest == _NOBODY[0][0] else tenant


def _path(value: str | None) -> Path | None:
    return Path(value).expanduser() if value else None


def _presented(authorization: str) -> bytes | None:
    scheme, _, token = authorization.partition(" ")
    return digest(token.strip()) if scheme.lower() == "bearer" and token.strip() else None


def _match(presented: bytes | None, entries: tuple) -> Tenant | None:
    matched = None
    for key_digest, tenant in entries:  # every digest is compared: the time taken says nothing of which matched
        if hmac.compare_digest(key_digest, presented or b"") and tenant is not None:
            matched = tenant
    return matched


def _match_or_401(request: Request, entries: tuple) -> Tenant:
    presented = _presented(request.headers.get("authorization", ""))
    tenant = _match(presented, entries)
    if tenant is not None:
        return tenant
    message = ("Incorrect API key provided." if presented else
               "You didn't provide an API key. Send it in the Authorization header: `Authorization: Bearer KEY`.")
    raise OpenAIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


_guard: KeyGuard | None = None


def configure(security: SecurityArgs) -> KeyGuard:
    """Called by the ingress at start: one ingress per process, so one guard per process."""
    global _guard
    _guard = KeyGuard(security)
    return _guard


def _current() -> KeyGuard:
    global _guard
    if _guard is None:  # not configured: the environment's keys still apply
        _guard = KeyGuard(SecurityArgs())
    return _guard


async def require_api_key(request: Request) -> Tenant:
    """FastAPI dependency for /v1/*: a configured API key (or the admin key), or 401 in OpenAI's shape. Returns
    the key's tenant (the anonymous one while no key is configured)."""
    return _current().check_api(request)


def tenant_of(authorization: str) -> Tenant | None:
    """The tenant of an Authorization header's key, None for a missing or unknown one; for the ingress's
    per-tenant limits, which act before the handler's own check."""
    return _current().tenant_of(authorization)


async def require_admin_key(request: Request) -> None:
    """FastAPI dependency for profiler, timeline and trace endpoints: see the module's rule."""
    _current().check_admin(request)
