"""Serve's direct ingress: the ingress replica's own HTTP server on the app's port, no proxy process in between.

Through Serve's proxy every streamed chunk is one more hop (a Ray streaming item from the ingress replica to the
proxy, then HTTP); with direct ingress (Ray 2.60, `RAY_SERVE_ENABLE_DIRECT_INGRESS`) the ingress replica serves
HTTP itself and the proxy stays up, idle, on a port of its own. Serve hands each ingress replica a port from a
range; here the range is the one port, so it applies where an app has one ingress replica (`make serve`'s).

Serve binds that port without SO_REUSEPORT, so a replica that replaces the ingress replica (a redeploy with new
arguments, a restart) fails to bind while the one it replaces still drains its streams, and Serve then blocks the
port for good: the app's HTTP port is gone. `share_port_with_predecessor` (called in the ingress replica) makes
Serve's server of this process set SO_REUSEPORT, so the new replica binds beside the draining one and the kernel
hands new connections to both until the old one closes.
"""
from __future__ import annotations

import os
from typing import Any

SERVE_SWITCH = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
INGRESS_ENV = "TOKENLINE_INGRESS"  # `direct` (the default) or `proxy`: who answers on the app's HTTP port
TOKENLINE_APP = ("deployments.app:build_app", "deployments.app.build_app")


def direct_ingress_refusal(apps: list[tuple[str, dict[str, Any]]]) -> str | None:
    """Why the HTTP port cannot be the ingress replica's own (None: it can), for the (import path, args) of each
    application: one port reaches the whole app only where it has one ingress replica."""
    from deployments.config import AppArgs

    if len(apps) != 1:
        return f"{len(apps)} applications, each with its own ingress"
    import_path, args = apps[0]
    if import_path not in TOKENLINE_APP:
        return f"{import_path} is not tokenline's app, whose ingress replica count this reads"
    try:
        app_args = AppArgs.model_validate(args or {})
    except ValueError as exc:
        return f"its arguments do not parse ({exc})"
    if app_args.ingress_max_replicas != 1:
        return f"the ingress may run {app_args.ingress_max_replicas} replicas (ingress_max_replicas)"
    return None


def direct_ingress_env(http_port: int) -> dict[str, str]:
    """The environment of Serve's processes for the ingress replica's server on `http_port` and nowhere else
    (Serve's range is [min, max)). Nothing balances in front of it here, so a replica that stops drains for its
    in-flight requests only (Serve's default also waits 30 s for a load balancer to notice), and a port given
    back is free at once for the replica that replaces it (the default holds it back for a minute)."""
    return {SERVE_SWITCH: "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http_port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http_port + 1),
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
            "RAY_SERVE_PORT_QUARANTINE_S": "0"}


def direct_ingress_enabled() -> bool:
    return os.environ.get(SERVE_SWITCH) == "1"


def share_port_with_predecessor() -> None:
    """In an ingress replica under direct ingress, before Serve starts its HTTP server (Serve starts it after the
    replica's constructor): that server's socket is bound with SO_REUSEPORT. Ray 2.60's
    `ray.serve._private.replica.start_asgi_http_server` takes the switch and the replica passes False."""
    from ray.serve._private import replica

    start = replica.start_asgi_http_server
    if getattr(start, "shares_port", False):
        return

    async def start_sharing(app, http_options, *, event_loop, enable_so_reuseport: bool = False):
        return await start(app, http_options, event_loop=event_loop, enable_so_reuseport=True)

    start_sharing.shares_port = True  # type: ignore[attr-defined]
    replica.start_asgi_http_server = start_sharing
