"""Where this code runs inside Ray Serve."""
from __future__ import annotations

from ray import serve


def replica_id() -> str:
    """This replica's unique id, the `replica` tag of its metrics; "local" outside a Serve replica."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a replica (a script driving EngineReplica directly)
        return "local"
