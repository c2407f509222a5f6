"""The session app's processes seen from a test: replica actors by deployment, their PIDs, RSS and engine state."""
from __future__ import annotations

import os
import time
from typing import Any

import psutil

from deployments.local import APP_NAME

ENGINE = "EngineReplica"
INGRESS = "OpenAIIngress"


def replica_actors(deployment: str) -> dict[str, Any]:
    """Live replica actors of one deployment, by replica id."""
    import ray

    prefix = f"SERVE_REPLICA::{APP_NAME}#{deployment}#"
    actors = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith(prefix):
            try:
                actors[entry["name"][len(prefix):]] = ray.get_actor(entry["name"], namespace="serve")
            except ValueError:  # gone between the listing and the lookup
                continue
    return actors


def _getpid(replica_actor: Any) -> int:
    return os.getpid()


def _user_callable(replica_actor) -> Any:
    return replica_actor._replica_impl._user_callable_wrapper.user_callable


def break_step_loop(replica_actor) -> None:
    """Runs inside a replica: the engine's next look at its queues raises, outside any step, as a failing device
    would: the engine's state is unknown."""
    engine = _user_callable(replica_actor).engine

    def fault() -> bool:
        raise RuntimeError("injected fault: the engine step loop dies")

    engine.engine.has_unfinished = fault


def _inject_step_fault(replica_actor, prompt_prefix: list[int] | None) -> None:
    engine = _user_callable(replica_actor).engine.engine
    if prompt_prefix is None:
        engine.inject_step_fault(lambda request: False)
    else:
        engine.inject_step_fault(lambda request: request.prompt_token_ids[:len(prompt_prefix)] == prompt_prefix)


def inject_step_fault(prompt_prefix: list[int] | None, timeout_s: float = 30.0) -> None:
    """Arms the engine's test hook in every engine replica: the next step holding a request whose prompt starts
    with `prompt_prefix` raises (None disarms it)."""
    import ray

    for actor in replica_actors(ENGINE).values():
        ray.get(actor.__ray_call__.remote(_inject_step_fault, prompt_prefix), timeout=timeout_s)


def _configure_security(replica_actor, security) -> None:
    from deployments import auth

    auth.configure(security)


def configure_ingress_security(security, timeout_s: float = 30.0) -> None:
    """Points every ingress replica's key guard at `security` (key files, env var names), as the app's `security`
    args do when it starts, without a redeploy."""
    import ray

    for actor in replica_actors(INGRESS).values():
        ray.get(actor.__ray_call__.remote(_configure_security, security), timeout=timeout_s)


def _object_census(replica_actor: Any) -> dict[str, int]:
    import collections
    import gc

    gc.collect()
    return dict(collections.Counter(type(o).__name__ for o in gc.get_objects()))


def object_census(deployment: str, timeout_s: float = 30.0) -> dict[str, dict[str, int]]:
    """Live Python objects by type in each replica of a deployment, after a full collection."""
    import ray

    return {replica_id: ray.get(actor.__ray_call__.remote(_object_census), timeout=timeout_s)
            for replica_id, actor in replica_actors(deployment).items()}


def grown_types(before: dict[str, int], after: dict[str, int], threshold: int) -> dict[str, int]:
    """Types that gained more than `threshold` objects. Weak references are left out: Ray keeps some for objects
    that live on, and a leaked referent shows under its own type anyway."""
    return {name: after[name] - before.get(name, 0) for name in after
            if name != "ReferenceType" and after[name] - before.get(name, 0) > threshold}


def replica_pids(deployment: str, timeout_s: float = 10.0) -> dict[str, int]:
    """PIDs of a deployment's replicas that answer within the timeout."""
    import ray

    pids = {}
    for replica_id, actor in replica_actors(deployment).items():
        try:
            pids[replica_id] = ray.get(actor.__ray_call__.remote(_getpid), timeout=timeout_s)
        except Exception:  # starting, stopping or dead
            continue
    return pids


def rss_mb(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for replica_id, pid in pids.items():
        try:
            out[replica_id] = psutil.Process(pid).memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            continue
    return out


def wait_until_idle(serve_app, timeout_s: float, num_replicas: int = 2) -> list:
    """Each engine replica's stats once none runs, queues or holds KV blocks (or when time runs out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = serve_app.engine_replica_stats()
        idle = all(s.num_running == 0 and s.num_waiting == 0 and s.num_used_kv_blocks == 0
                   and s.num_active_streams == 0 for s in stats)
        if (idle and len(stats) == num_replicas) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def wait_until_busy(serve_app, timeout_s: float) -> list:
    """Each engine replica's stats once one runs a request that holds KV blocks (or when time runs out). A replica
    that misses a stats call's timeout is left out of that call: this asks again."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = serve_app.engine_replica_stats()
        busy = sum(s.num_running for s in stats) >= 1 and sum(s.num_used_kv_blocks for s in stats) > 0
        if busy or time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


def as_started(serve_app, timeout_s: float = 240) -> list:
    """The session's app as the session started it, its engine replicas answering (their stats returned).

    Tests that redeploy the app do not put it back: they run last (tests/conftest.py), and the next one either
    redeploys its own arguments over what it finds or, needing the app as started, calls this, which redeploys it
    only where it was changed: each put-back was a rolling update of 20-30 s.
    """
    started = serve_app.started_args
    if serve_app.args != started:
        if serve_app.args.engine.tensor_parallel_size > 1:
            from ray import serve

            # A rolling update starts the new replicas first: they would wait forever for the CPUs the ranks hold.
            serve.delete(APP_NAME)
        serve_app.redeploy(started)
    return wait_for_replicas(serve_app, started.num_engine_replicas, timeout_s)


def wait_for_replicas(serve_app, num_replicas: int, timeout_s: float, without: set[str] = frozenset()) -> list:
    """Stats of the engine replicas once exactly `num_replicas` answer and none of `without` is among them."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = serve_app.engine_replica_stats(timeout_s=5)
        ids = {s.replica_id for s in stats}
        if len(stats) == num_replicas and not ids & without:
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine replicas {sorted(ids)}; wanted {num_replicas} without {sorted(without)}")
        time.sleep(1)


def _set_max_num_seqs(replica_actor, max_num_seqs: int) -> int:
    scheduler = _user_callable(replica_actor).engine.engine.scheduler
    before, scheduler.max_num_seqs = scheduler.max_num_seqs, max_num_seqs
    return before


def set_engine_max_num_seqs(max_num_seqs: int, timeout_s: float = 30.0) -> dict[str, int]:
    """Sets every engine replica's batch slots (a replica's capacity in requests at once) and returns what each
    had: tests that need an engine past capacity get there with a few streams instead of hundreds."""
    import ray

    return {replica_id: ray.get(actor.__ray_call__.remote(_set_max_num_seqs, max_num_seqs), timeout=timeout_s)
            for replica_id, actor in replica_actors(ENGINE).items()}
