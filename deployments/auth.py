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

import hashlib
import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from deployments.errors import OpenAIError

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


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


_NOBODY = frozenset({bytes(32)})  # no key hashes to 32 zero bytes


def _parse_keys(text: str, separator: str | None) -> frozenset[bytes]:
    lines = text.split(separator) if separator else text.splitlines()
    return frozenset(_digest(k) for line in lines if (k := line.strip()) and not k.startswith("#"))


@dataclass
class _KeySource:
    """One env var and/or one file; the file's keys are cached by its (mtime, size) and read again on change."""

    env: str
    path: Path | None
    _stamp: tuple[int, int] | None = None
    _file_keys: frozenset[bytes] = frozenset()

    def digests(self) -> frozenset[bytes]:
        keys = _parse_keys(os.environ.get(self.env, ""), ",")
        return keys | self._read_file() if self.path else keys

    def _read_file(self) -> frozenset[bytes]:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp != self._stamp:
                keys = _parse_keys(self.path.read_text(), None)
                self._stamp = stamp
                if keys:
                    self._file_keys = keys
                    log.info("read %d key(s) from %s", len(keys), self.path)
                else:  # emptied, or caught mid-rewrite: a configured file never opens the server
                    self._file_keys = _NOBODY
                    log.error("key file %s holds no key: every key is refused until it does", self.path)
        except (OSError, UnicodeDecodeError) as exc:
            # A key file that cannot be read must not open the server: no key matches until it is back.
            if self._file_keys is not _NOBODY:
                log.error("key file %s cannot be read (%s): every key is refused", self.path,
                          getattr(exc, "strerror", None) or type(exc).__name__)
            self._stamp, self._file_keys = None, _NOBODY
        return self._file_keys


class KeyGuard:
    """Checks bearer keys against the configured API keys and admin key."""

    def __init__(self, security: SecurityArgs) -> None:
        self._api = _KeySource(security.api_keys_env, _path(security.api_keys_file))
        self._admin = _KeySource(security.admin_key_env, _path(security.admin_key_file))

    def check_api(self, request: Request) -> None:
        api, admin = self._api.digests(), self._admin.digests()
        if not api and not admin:
            return
        _match_or_401(request, api | admin)

    def check_admin(self, request: Request) -> None:
        api, admin = self._api.digests(), self._admin.digests()
        if admin:
            _match_or_401(request, admin)
        elif api:
            raise OpenAIError(403, f"admin endpoints are closed: API keys are on and no admin key is configured "
                                   f"(set {self._admin.env} or security.admin_key_file)",
                              code="admin_key_not_configured", type="permission_error")


def _path(value: str | None) -> Path | None:
    return Path(value).expanduser() if value else None


def _match_or_401(request: Request, digests: frozenset[bytes]) -> None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    presented = _digest(token.strip()) if scheme.lower() == "bearer" and token.strip() else None
    matched = False
    for digest in digests:  # every digest is compared, so the time taken says nothing about which one matched
        matched |= hmac.compare_digest(digest, presented or b"")
    if matched:
        return
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


async def require_api_key(request: Request) -> None:
    """FastAPI dependency for /v1/*: a configured API key (or the admin key), or 401 in OpenAI's shape."""
    _current().check_api(request)


async def require_admin_key(request: Request) -> None:
    """FastAPI dependency for profiler, timeline and trace endpoints: see the module's rule."""
    _current().check_admin(request)
