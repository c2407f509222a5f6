"""Ray's token auth, seen from outside the cluster: where the token is, the header that carries it, and what to tell
a person who opens the dashboard.

In Ray 2.60 (since 2.59) a local cluster started by `ray.init()` turns token auth on unless `RAY_AUTH_MODE` says otherwise,
and creates `~/.ray/auth_token` when no token exists. The token is looked up, highest first, in `$RAY_AUTH_TOKEN`,
the file `$RAY_AUTH_TOKEN_PATH`, then `~/.ray/auth_token` (Ray's documented order: docs.ray.io, "Token
Authentication"). Ray's Python loader for it is private, so the order is followed here.
"""
from __future__ import annotations

import json
import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TOKEN_PATH = Path("~/.ray/auth_token")


@dataclass(frozen=True)
class TokenSource:
    where: str  # for a person: "$RAY_AUTH_TOKEN" or a file path
    path: Path | None  # the file, when the token is in one


def token_source() -> TokenSource:
    if os.environ.get("RAY_AUTH_TOKEN"):
        return TokenSource("$RAY_AUTH_TOKEN", None)
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        path = Path(os.environ["RAY_AUTH_TOKEN_PATH"])
        return TokenSource(str(path), path)
    return TokenSource(str(DEFAULT_TOKEN_PATH), DEFAULT_TOKEN_PATH.expanduser())


def read_token() -> str | None:
    source = token_source()
    if source.path is None:
        return os.environ["RAY_AUTH_TOKEN"].strip()
    try:
        return source.path.read_text().strip() or None
    except OSError:
        return None


def auth_headers() -> dict[str, str]:
    """The Authorization header for Ray's dashboard and its REST API (ignored by a cluster with auth off)."""
    token = read_token()
    return {"Authorization": f"Bearer {token}"} if token else {}


def dashboard_auth_mode(dashboard_url: str, timeout_s: float = 5.0) -> str:
    """"token" or "disabled", from the dashboard's own unauthenticated endpoint; "unknown" if it does not answer."""
    try:
        with urllib.request.urlopen(f"{dashboard_url}/api/authentication_mode", timeout=timeout_s) as response:
            return str(json.loads(response.read()).get("authentication_mode", "unknown"))
    except (OSError, ValueError):
        return "unknown"


def dashboard_help(dashboard_url: str) -> str:
    """What a person needs to open the dashboard and call its API, in a few lines."""
    mode = dashboard_auth_mode(dashboard_url)
    if mode == "disabled":
        return f"Ray dashboard: {dashboard_url} (token auth off: RAY_AUTH_MODE=disabled)"
    source = token_source()
    value = "$RAY_AUTH_TOKEN" if source.path is None else f"$(cat {source.where})"
    state = "token auth on: the page asks for the token once" if mode == "token" else "if the page asks for a token"
    return (f"Ray dashboard: {dashboard_url} ({state}; it is in {source.where}, and `ray get-auth-token` prints it)\n"
            f"  its REST API: curl -H \"Authorization: Bearer {value}\" {dashboard_url}/api/serve/applications/\n"
            f"  RAY_AUTH_MODE=disabled starts Ray without token auth (anyone who reaches the port may run code)")
