"""Replica-count policies for the engine deployment, and an offline simulator to tune them.

`policy.py` holds the queue + KV policy (pure) and its Ray Serve adapter, `serve_rules.py` Serve's own default
policy and the delays and bounds Serve applies around any policy; `simulator.py` replays a workload against a
policy on replicas whose steps are timed by a model fitted to the real engine (`step_model.py`, `profiles/`).
Nothing here imports Ray or the engine.
"""
from autoscaling.policy import QueueKVConfig, QueueKVPolicy, queue_kv_decision
from autoscaling.signals import DeploymentSignals, ReplicaSignals

__all__ = ["DeploymentSignals", "QueueKVConfig", "QueueKVPolicy", "ReplicaSignals", "queue_kv_decision"]
