"""`make serve`: checks first, then a local Ray on fixed loopback ports, then Serve's own `serve run` against it.

    python -m deployments.run serve_config.yaml
    python -m deployments.run deployments.app:build_app num_engine_replicas=1

The HTTP port is the ingress replica's own server (Serve's direct ingress) where the app has one ingress replica,
as `make serve`'s has: no proxy process between the client and the ingress, which on a 2-core node cuts the
serving's CPU per streamed token to a third or less (README: make bench-serve). Serve's proxy still runs, on
`--proxy-port`, in front of the same app. With `--ingress proxy` (or TOKENLINE_INGRESS=proxy), or an ingress that
may scale out, the proxy holds the HTTP port.

Where it finds NVIDIA GPUs it lays out one engine replica per GPU (deployments/node_layout.py). Before Ray starts:
every port it would take is free, and each application builds (its builder checks the model path), so a mistake
ends the command at once with what to change. `serve run` alone would start Ray with a random
metrics port; starting Ray here first pins every port. Ctrl-C or SIGTERM reaches `serve run`, which shuts Serve
down; then this process's Ray stops with it.
"""
from __future__ import annotations

import argparse
import errno
import functools
import importlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from deployments.direct_ingress import INGRESS_ENV, direct_ingress_env, direct_ingress_refusal
from deployments.local import free_port
from deployments.node_priority import (NICE_ENV, WORKER_NICENESS_ENV, background_nice, lower_background,
                                       worker_niceness_env)

log = logging.getLogger("tokenline.run")
STOP_GRACE_S = 60.0  # after Ctrl-C, how long `serve run` may take to shut Serve down before it is killed


@dataclass(frozen=True)
class Port:
    number: int
    what: str  # what would listen there, for the message
    flag: str  # this command's option for it
    make_var: str  # `make serve`'s variable for it


def busy_ports(host: str, ports: list[Port]) -> list[Port]:
    """The ports something already listens on (or another of `ports` takes too)."""
    busy, seen = [], set()
    for port in ports:
        if port.number in seen:
            busy.append(port)
            continue
        seen.add(port.number)
        with socket.socket() as probe:
            # As the servers themselves bind: a port whose old connections linger in TIME_WAIT is free to them.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port.number))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                busy.append(port)
    return busy


def applications(target: str, app_args: list[str]) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    """(import path, args) of each application `serve run target` would deploy, and the HTTP port it would use."""
    from ray.serve.config import HTTPOptions
    from ray.serve.schema import ServeDeploySchema

    if Path(target).is_file():
        config = ServeDeploySchema.model_validate(yaml.safe_load(Path(target).read_text()))
        return [(app.import_path, app.args) for app in config.applications], config.http_options.port
    pairs = [arg.partition("=") for arg in app_args]
    if bad := [key for key, sep, _ in pairs if not sep]:
        raise ValueError(f"application arguments are key=value; got {bad}")
    return [(target, {key: value for key, _, value in pairs})], HTTPOptions().port


def check_builds(import_path: str, args: dict[str, Any]) -> None:
    """Calls the application's builder as Serve would, so its checks (the model path) run before Ray starts."""
    from ray.serve import Application

    module, _, attr = import_path.rpartition(":") if ":" in import_path else import_path.rpartition(".")
    builder = getattr(importlib.import_module(module), attr)
    if callable(builder) and not isinstance(builder, Application):
        builder(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address of the HTTP API, the dashboard and metrics")
    parser.add_argument("--http-port", type=int, default=None, help="overrides http_options.port of the config")
    parser.add_argument("--dashboard-port", type=int, default=8265)
    parser.add_argument("--metrics-port", type=int, default=8080, help="Ray's Prometheus export port")
    parser.add_argument("--ingress", choices=("direct", "proxy"), default=os.environ.get(INGRESS_ENV, "direct"),
                        help="who answers on the HTTP port: the ingress replica itself (where the app has one) or "
                             f"Serve's proxy (default: ${INGRESS_ENV}, else direct)")
    parser.add_argument("--proxy-port", type=int, default=None,
                        help="Serve's proxy when the ingress answers directly (default: a free port)")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may hand out (default: all)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs for engine replicas, one replica each (default: those found; 0: the CPU layout)")
    parser.add_argument("target", help="a Serve config YAML or an import path such as deployments.app:build_app")
    parser.add_argument("app_args", nargs="*", help="key=value arguments for an import path")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # Ctrl-C and SIGTERM interrupt the start, even when started in the background (where the shell leaves SIGINT
    # ignored, which `serve run` would inherit).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)

    workdir = Path(tempfile.mkdtemp(prefix="tokenline-serve-"))
    try:
        return check_then_serve(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def check_then_serve(args: argparse.Namespace, workdir: Path) -> int:
    """Lays the engine replicas out on this node, checks the ports and the app, then serves."""
    from deployments.node_layout import detect_gpus, layout_target

    try:
        num_gpus = detect_gpus() if args.gpus is None else args.gpus
        target, app_args, layout = layout_target(args.target, args.app_args, num_gpus, workdir)
        log.info("engine layout: %s", layout)
        apps, config_port = applications(target, app_args)
        http_port = args.http_port or config_port
        proxy_port = None
        if args.ingress == "direct":
            if (refusal := direct_ingress_refusal(apps)) is None:
                proxy_port = args.proxy_port or free_port(args.host)
            else:
                log.info("Serve's proxy answers on the HTTP port: %s", refusal)
        ports = [Port(http_port, "the OpenAI API", "--http-port", "HTTP_PORT"),
                 Port(args.dashboard_port, "Ray's dashboard", "--dashboard-port", "DASHBOARD_PORT"),
                 Port(args.metrics_port, "Ray's Prometheus metrics", "--metrics-port", "METRICS_PORT")]
        if proxy_port is not None:
            ports.append(Port(proxy_port, "Serve's proxy", "--proxy-port", "PROXY_PORT"))
        if busy := busy_ports(args.host, ports):
            raise SystemExit("\n".join(
                f"port {p.number} on {args.host} ({p.what}) is already in use: stop what listens there, or choose "
                f"another with {p.flag} (make serve {p.make_var}=...)" for p in busy))
        nice = background_nice()
        log.info("checking the application before Ray starts (the model path)")
        for import_path, builder_args in apps:
            check_builds(import_path, builder_args)
    except (OSError, ValueError, ImportError) as exc:
        raise SystemExit(f"cannot serve {args.target}: {exc}") from None
    return serve(args, target, app_args, http_port, proxy_port, nice)


def serve(args: argparse.Namespace, target: str, app_args: list[str], http_port: int,
          proxy_port: int | None, nice: int | None) -> int:
    import ray
    from ray import serve as ray_serve

    from deployments.ray_auth import dashboard_help

    # Private arguments: ray.init has no public ones for these (`ray start --node-ip-address` and
    # `--metrics-export-port` are the CLI's); they keep Ray on loopback and its Prometheus export on a known port.
    # `serve run` below prints the replicas' logs; this driver printing them too would show each line twice.
    # Serve reads its direct-ingress settings from the environment of each of its processes, which the local Ray
    # started here hands on to every worker.
    if proxy_port is not None:
        os.environ.update(direct_ingress_env(http_port))
    if nice is not None:  # the replicas at this process's niceness; Ray's bookkeeping lowered below
        os.environ.update(worker_niceness_env())
    ray.init(num_cpus=args.num_cpus, include_dashboard=True, dashboard_host=args.host,
             dashboard_port=args.dashboard_port, _node_ip_address=args.host, _metrics_export_port=args.metrics_port,
             namespace="serve", log_to_driver=False)
    # Serve keeps the HTTP options it starts with, so the port checked above is the one it binds.
    ray_serve.start(http_options={"host": args.host, "port": proxy_port or http_port})
    if proxy_port is not None:
        log.info("the ingress replica answers on %s:%d itself; Serve's proxy in front of the same app on %s:%d",
                 args.host, http_port, args.host, proxy_port)
    log.info("%s", dashboard_help(f"http://{args.host}:{args.dashboard_port}"))
    log.info("Prometheus metrics on http://%s:%d/metrics", args.host, args.metrics_port)
    serve_cli = Path(sys.executable).with_name("serve")
    command = [str(serve_cli) if serve_cli.exists() else shutil.which("serve") or "serve", "run", "--address",
               ray.get_runtime_context().gcs_address, target, *app_args]
    stop_asked: list[float] = []

    def stop(signum: int, frame: object) -> None:
        if not stop_asked and child.poll() is None:
            child.send_signal(signal.SIGINT)
        stop_asked.append(time.monotonic())

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    # Its own session: Ctrl-C reaches it once, from here, and not a second time from the terminal mid-shutdown.
    child = subprocess.Popen(command, start_new_session=True)

    replica_nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + int(os.environ.get(WORKER_NICENESS_ENV, "15")))

    def prioritize(again: bool = False) -> None:
        """Called once Serve's controller and proxy run, and `again` once the app answers (late subprocesses)."""
        if lowered := lower_background(proxy_serves=proxy_port is None, nice=nice):
            log.info("CPU priority: %d %sof Ray's processes that serve no request (GCS, dashboard, log monitor, "
                     "agents, Serve's controller%s, this launcher) at nice %d; the replicas at nice %d (%s=off "
                     "leaves Ray's priorities)", len(lowered), "more " if again else "",
                     ", its proxy" if proxy_port is not None else "", nice, replica_nice, NICE_ENV)

    base_url = f"http://{args.host}:{http_port}"
    prioritize()
    threading.Thread(target=announce_when_ready, args=(base_url, child, functools.partial(prioritize, again=True)),
                     daemon=True).start()
    while child.poll() is None:
        if stop_asked and time.monotonic() - stop_asked[0] > STOP_GRACE_S:
            log.warning("serve run did not stop within %.0f s of Ctrl-C; killing it", STOP_GRACE_S)
            child.kill()
        time.sleep(0.2)
    ray.shutdown()
    return child.returncode


def announce_when_ready(base_url: str, child: subprocess.Popen, on_ready: Callable[[], None]) -> None:
    """One line once the API answers: the first start (kernel build, model load) takes a while, and says so."""
    started = time.monotonic()
    log.info("the OpenAI API will answer on %s/v1 once the engine replicas are up", base_url)
    while child.poll() is None:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5) as response:
                if response.status == 200:
                    log.info("ready after %.0f s: the OpenAI API answers on %s/v1 (Ctrl-C stops it)",
                             time.monotonic() - started, base_url)
                    on_ready()
                    return
        except OSError:  # not up yet
            pass
        time.sleep(2)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
