"""Where this code runs inside Ray Serve."""
from __future__ import annotations

import logging

from ray import serve

SERVE_LOGGER = "ray.serve"  # the logger Serve's docs give replicas: its handlers write the replica's log and console
OUR_LOGGERS = ("engine", "deployments")


class _ToServeLogger(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(SERVE_LOGGER).handle(record)


def log_through_serve() -> None:
    """Sends our packages' INFO records through Serve's replica logger. Serve sets up only its own, so without
    this the model load, the kernel build and the engine's start line would be dropped (Python's last-resort
    handler shows warnings only). Idempotent."""
    for name in OUR_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        if not any(isinstance(h, _ToServeLogger) for h in logger.handlers):
            logger.addHandler(_ToServeLogger())


def replica_id() -> str:
    """This replica's unique id, the `replica` tag of its metrics; "local" outside a Serve replica."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a replica (a script driving EngineReplica directly)
        return "local"
