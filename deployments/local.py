"""A local Ray cluster running the app, on loopback only: for tests, benchmarks and scripts.

Everything it starts belongs to this process's Ray session, and `stop()` ends all of it.
"""
from __future__ import annotations

import json
import logging
import os
import random
import socket
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from deployments.config import AppArgs
from deployments.direct_ingress import direct_ingress_env
from deployments.node_priority import lower_background, worker_niceness_env
from deployments.ray_auth import auth_headers
from deployments.records import ReplicaStats

log = logging.getLogger(__name__)

APP_NAME = "tokenline"
REPLICA_ACTOR_PREFIX = f"SERVE_REPLICA::{APP_NAME}#EngineReplica#"


def ephemeral_port_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = f.read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Distinct free ports below the ephemeral range (all held open until every one is chosen). A port the system
    picks for a bind to port 0 is in that range, and once let go, the next outgoing connection of any process (Ray's
    processes connect to each other while a node starts) may take it as its local port before the server told to
    listen on it binds it: "Address already in use". Below the range only a bind can take it."""
    low = ephemeral_port_range()[0]
    candidates = random.SystemRandom().sample(range(max(1024, low - 12000), low), 400)
    with ExitStack() as stack:
        held = []
        for port in candidates:
            s = stack.enter_context(socket.socket())
            try:
                s.bind((host, port))
            except OSError:
                continue
            held.append(port)
            if len(held) == count:
                return held
    raise RuntimeError(f"fewer than {count} free ports below {low} on {host}")


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


@dataclass
class LocalServe:
    base_url: str  # e.g. http://127.0.0.1:8000, the OpenAI API lives under /v1
    model: str  # the served model name clients send
    metrics_url: str  # Ray's Prometheus export of this node
    args: AppArgs
    session_dir: str  # this Ray session's folder (its logs are under logs/)
    dashboard_url: str | None = None  # the Ray dashboard, when started with one
    proxy_url: str | None = None  # Serve's proxy: base_url itself unless the ingress replica answers directly

    def dashboard_json(self, path: str, timeout_s: float = 30.0) -> Any:
        """GET a Ray dashboard API path (e.g. /api/serve/applications/), with this cluster's auth token if any."""
        if self.dashboard_url is None:
            raise RuntimeError("this cluster was started without the dashboard (start(..., dashboard_port=...))")
        request = urllib.request.Request(f"{self.dashboard_url}{path}", headers=auth_headers())
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())

    def engine_replica_stats(self, timeout_s: float = 10.0) -> list[ReplicaStats]:
        """Each ready engine replica's own stats, asked of every replica actor (a handle call reaches just one).

        A replica that is still starting, or gone, does not answer in time and is left out.
        """
        import ray

        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith(REPLICA_ACTOR_PREFIX)]
        refs = []
        for name in names:
            try:
                refs.append(ray.get_actor(name, namespace="serve").record_routing_stats.remote())
            except ValueError:  # it went away between the listing and the lookup
                continue
        stats = []
        for ref in refs:
            try:
                stats.append(ReplicaStats(**ray.get(ref, timeout=timeout_s)))
            except Exception as exc:
                log.info("an engine replica did not report its stats: %r", exc)
        return stats

    def scrape_metrics(self, timeout_s: float = 10.0) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=timeout_s) as response:
            return response.read().decode()

    def redeploy(self, args: AppArgs, ready_timeout_s: float = 300.0) -> None:
        """Deploys `args` over the running app (same name and route) and waits until it answers.

        Serve gives every `serve.run` a new code version, so each deployment's replicas are replaced, in a
        rolling update.
        """
        from ray import serve

        from deployments.app import build_app

        serve.run(build_app(args), name=APP_NAME, route_prefix="/")
        self.args = args
        self.model = args.model_name()
        wait_ready(self.base_url, ready_timeout_s)

    def stop(self) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def start(args: AppArgs, num_cpus: int = 2, http_port: int | None = None,
          metrics_report_interval_ms: int | None = None, ready_timeout_s: float = 300.0,
          dashboard_port: int | None = None, direct_ingress: bool = False,
          background_nice: int | None = None) -> LocalServe:
    """Ray and the app on loopback, Ray's Prometheus export on a port Ray picks. Metrics keep Ray's report period
    unless told (tests shorten it).

    With `direct_ingress` (as `make serve` runs an app of one ingress replica: deployments.direct_ingress), the
    ingress replica answers on `http_port` itself and Serve's proxy on `.proxy_url`.

    With `dashboard_port`, Ray's dashboard (its Serve view and API included) listens on 127.0.0.1 there; it adds
    a dozen idle processes (~1 GB resident), so it is off unless asked for.

    With `background_nice` (as `make serve`: deployments.node_priority), the replicas run at this process's
    niceness and Ray's processes that serve no request at that niceness; this process keeps its own.
    """
    import ray
    from ray import serve

    from deployments.app import build_app

    if direct_ingress and args.ingress_max_replicas != 1:
        raise ValueError("direct ingress serves one port from one ingress replica: set ingress_max_replicas=1")
    http_port = http_port or free_port()
    proxy_port = free_port() if direct_ingress else http_port
    system_config = {"metrics_report_interval_ms": metrics_report_interval_ms} if metrics_report_interval_ms else {}
    dashboard = {"include_dashboard": False}
    if dashboard_port:
        dashboard = {"include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": dashboard_port}
    # Private arguments, as ray.init has no public ones for them: `_node_ip_address` keeps every Ray process on
    # loopback (`ray start --node-ip-address` is the CLI's door), `_system_config` shortens the metrics period.
    # Serve's processes read direct ingress's settings from the environment the raylet started here hands on;
    # this process's own environment is put back once it has.
    saved = dict(os.environ)
    if direct_ingress:
        os.environ.update(direct_ingress_env(http_port))
    if background_nice is not None:
        os.environ.update(worker_niceness_env())
    try:
        context = ray.init(num_cpus=num_cpus, _node_ip_address="127.0.0.1", log_to_driver=False,
                           configure_logging=False, _system_config=system_config, **dashboard)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    metrics_port = context.address_info["metrics_export_port"]
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": proxy_port})
        app = build_app(args)
        serve.run(app, name=APP_NAME, route_prefix="/")
        local = LocalServe(base_url=f"http://127.0.0.1:{http_port}", model=args.model_name(),
                           metrics_url=f"http://127.0.0.1:{metrics_port}/metrics", args=args,
                           session_dir=context.address_info["session_dir"],
                           dashboard_url=f"http://127.0.0.1:{dashboard_port}" if dashboard_port else None,
                           proxy_url=f"http://127.0.0.1:{proxy_port}")
        wait_ready(local.base_url, ready_timeout_s)
        lower_background(proxy_serves=not direct_ingress, nice=background_nice, include_root=False)
    except BaseException:
        serve.shutdown()
        ray.shutdown()
        raise
    return local


def wait_ready(base_url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=10) as response:
                if json.loads(response.read()).get("status") == "ok":
                    return
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(0.5)
    raise TimeoutError(f"{base_url}/health did not answer within {timeout_s:.0f}s: {last!r}")
