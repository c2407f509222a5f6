"""`make serve`: a local Ray on fixed loopback ports (dashboard, Prometheus export), then Serve's own `serve run`.

    python -m deployments.run serve_config.yaml
    python -m deployments.run deployments.app:build_app num_engine_replicas=1

`serve run` alone would start Ray with a random metrics port; starting Ray here first pins every port, and
Ctrl-C (handled by `serve run`) shuts Serve down, then this process's Ray with it.
"""
from __future__ import annotations

import argparse
import logging
import shutil
import signal
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("tokenline.run")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address of the HTTP API, the dashboard and metrics")
    parser.add_argument("--http-port", type=int, default=None, help="overrides http_options.port of the config")
    parser.add_argument("--dashboard-port", type=int, default=8265)
    parser.add_argument("--metrics-port", type=int, default=8080, help="Ray's Prometheus export port")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may hand out (default: all)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs for engine replicas, one replica each (default: those found; 0: the CPU layout)")
    parser.add_argument("target", help="a Serve config YAML or an import path such as deployments.app:build_app")
    parser.add_argument("app_args", nargs="*", help="key=value arguments for an import path")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # Ctrl-C and SIGTERM both reach `serve run`'s clean shutdown, even when started in the background
    # (where the shell leaves SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)

    from deployments.node_layout import detect_gpus, layout_target

    workdir = Path(tempfile.mkdtemp(prefix="tokenline-serve-"))
    num_gpus = detect_gpus() if args.gpus is None else args.gpus
    target, app_args, layout = layout_target(args.target, args.app_args, num_gpus, workdir)
    log.info("engine layout: %s", layout)

    import ray
    from ray import serve
    from ray.serve.scripts import cli

    ray.init(num_cpus=args.num_cpus, include_dashboard=True, dashboard_host=args.host,
             dashboard_port=args.dashboard_port, _node_ip_address=args.host, _metrics_export_port=args.metrics_port,
             namespace="serve")
    if args.http_port is not None:
        # Serve keeps the HTTP options it started with, so the config's own port no longer applies.
        serve.start(http_options={"host": args.host, "port": args.http_port})
    log.info("Ray dashboard on http://%s:%d, Prometheus metrics on http://%s:%d/metrics", args.host,
             args.dashboard_port, args.host, args.metrics_port)
    try:
        cli.main(args=["run", target, *app_args], prog_name="serve", standalone_mode=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
