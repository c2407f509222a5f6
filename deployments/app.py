"""The app builder: `serve run deployments.app:build_app num_engine_replicas=2 ...` or `serve run serve_config.yaml`."""
from __future__ import annotations

import os
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import BackpressureConfig

from deployments.autoscaling_config import engine_autoscaling_config
from deployments.config import AppArgs
from deployments.engine_replica import EngineReplica
from deployments.ingress import OpenAIIngress
from deployments.router import request_router_config
from engine import GOMP_SPINCOUNT
from engine.loader import check_model_source, read_model_args
from engine.tp_layout import check_shardable

# Generate runs on the engine replica's main event loop rather than a second one on its own thread: each
# streamed chunk skips a thread hop, and the engine's step thread fights one fewer thread for the GIL (measured
# on 2 CPUs: ~15% more output tokens/s at 32 streams; the same switch on the ingress showed no gain).
# GOMP_SPINCOUNT: OpenMP's idle thread spins ~0.1 ms, not several, after torch's own parallel ops, so as not to hold
# a core the kernels' threads need (engine/__init__.py).
ENGINE_REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                      "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", GOMP_SPINCOUNT)}


def build_app(args: AppArgs) -> Application:
    """Engine replicas (one accelerator each, or a CPU share) behind one autoscaled OpenAI ingress."""
    if not isinstance(args, AppArgs):
        args = AppArgs.model_validate(args)
    # Resolve defaults here, once, so every replica loads the same file; a wrong path fails here, at once, and not
    # in every replica's constructor, which Serve would retry.
    check_model_source(args.model_path())
    args = args.model_copy(update={"model": args.model_path(), "served_model_name": args.model_name()})
    if args.ingress_max_replicas < args.ingress_min_replicas:
        raise ValueError(f"ingress_max_replicas ({args.ingress_max_replicas}) is below ingress_min_replicas "
                         f"({args.ingress_min_replicas})")
    actor_options: dict[str, Any] = {"num_cpus": args.engine_num_cpus,
                                     "runtime_env": {"env_vars": ENGINE_REPLICA_ENV}}
    if args.engine_num_gpus:
        actor_options["num_gpus"] = args.engine_num_gpus
    # Autoscaled, `num_engine_replicas` is the count Serve starts with (initial_replicas).
    autoscaling = engine_autoscaling_config(args.autoscaling, args.num_engine_replicas)
    engine_options = _placement(args)
    engine = serve.deployment(EngineReplica, name="EngineReplica").options(
        num_replicas=None if autoscaling else args.num_engine_replicas, autoscaling_config=autoscaling,
        max_ongoing_requests=args.engine_max_ongoing_requests,
        ray_actor_options=actor_options, health_check_period_s=5, graceful_shutdown_timeout_s=args.limits.drain_s,
        max_queued_requests=args.limits.engine_max_queued_requests,
        request_router_config=request_router_config(args), **engine_options,
    ).bind(args)
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress").options(
        autoscaling_config={"min_replicas": args.ingress_min_replicas, "max_replicas": args.ingress_max_replicas,
                            "initial_replicas": args.ingress_min_replicas,
                            "target_ongoing_requests": args.ingress_target_ongoing_requests},
        max_ongoing_requests=args.ingress_max_ongoing_requests,
        ray_actor_options={"num_cpus": args.ingress_num_cpus},
        graceful_shutdown_timeout_s=args.limits.drain_s,
        # Past it the proxy answers 503 itself (plain text, with Retry-After); below it the ingress refuses first.
        max_queued_requests=args.limits.ingress_max_queued_requests,
        backpressure_config=BackpressureConfig(retry_after_s=args.limits.retry_after_s),
    )
    return ingress.bind(engine, args)


def _placement(args: AppArgs) -> dict[str, Any]:
    """With tensor parallelism, one bundle per rank on one node (the replica itself runs in the first; its other
    ranks, Ray actors, in the others): Serve reserves and frees them with the replica, and autoscaling counts
    replicas."""
    size = args.engine_args().tensor_parallel_size
    if size == 1:
        return {}
    check_shardable(read_model_args(args.model_path()), size)  # here, once, not in every replica Serve retries
    bundle = {"CPU": args.engine_num_cpus} | ({"GPU": args.engine_num_gpus} if args.engine_num_gpus else {})
    if not any(bundle.values()):
        raise ValueError("tensor_parallel_size > 1 needs engine_num_cpus or engine_num_gpus > 0: each rank is "
                         "placed in a bundle of its own")
    return {"placement_group_bundles": [bundle] * size, "placement_group_strategy": "STRICT_PACK"}
