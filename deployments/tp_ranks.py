"""The other tensor-parallel ranks of an engine replica as Ray actors, one per bundle of the replica's placement group.

Serve reserves the group (`placement_group_bundles`, one bundle per rank, STRICT_PACK: one node, so the ranks meet
on loopback and share memory) and runs the replica itself in bundle 0; rank r runs in bundle r. The actors are the
replica's children: they die with it, and when one of them dies the replica's engine fails and the replica exits,
so Serve replaces the whole group.
"""
from __future__ import annotations

import logging

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.config import EngineConfig
from engine.tp_group import RankFailure
from engine.tp_ranks import RankSpec, run_rank

log = logging.getLogger(__name__)

RANK_ACTOR_PREFIX = "tokenline-tp-rank"


@ray.remote(max_restarts=0, max_task_retries=0)
class RankActor:
    """One rank: `run` loads its shard and serves steps until rank 0 says stop (or fails)."""

    def run(self, spec: RankSpec) -> None:
        logging.basicConfig(level=logging.INFO,
                            format=f"[rank {spec.rank}] %(levelname)s %(name)s: %(message)s")
        run_rank(spec)


class RayRanks:
    """RankLauncher for an engine replica: ranks 1..N-1 as actors in its placement group."""

    def __init__(self, replica_id: str, num_cpus: float, num_gpus: float) -> None:
        self.replica_id, self.num_cpus, self.num_gpus = replica_id, num_cpus, num_gpus
        self.actors: list = []
        self.runs: list = []

    def device(self, rank: int, config: EngineConfig) -> str:
        return config.device  # each rank's process sees only the GPU of its own bundle

    def start(self, specs: list[RankSpec]) -> None:
        group = get_current_placement_group()
        if group is None:
            raise RuntimeError("tensor parallelism on Ray needs the replica in a placement group of one bundle per "
                               "rank (the app sets placement_group_bundles when tensor_parallel_size > 1)")
        for spec in specs:
            actor = RankActor.options(
                name=f"{RANK_ACTOR_PREFIX}-{spec.rank}-{self.replica_id}", num_cpus=self.num_cpus,
                num_gpus=self.num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=spec.rank),
            ).remote()
            self.actors.append(actor)
            self.runs.append(actor.run.remote(spec))

    def check(self) -> None:
        done, _ = ray.wait(self.runs, num_returns=1, timeout=0) if self.runs else ([], [])
        for ref in done:
            rank = self.runs.index(ref) + 1
            try:
                ray.get(ref, timeout=0)
                reason = "returned"
            except Exception as exc:  # its death, or the error that ended it
                reason = f"failed: {type(exc).__name__}: {str(exc)[:500]}"
            raise RankFailure(f"tensor-parallel rank {rank} (Ray actor) {reason}")

    def stop(self, timeout_s: float) -> None:
        if self.runs:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout_s)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors.clear()
        self.runs.clear()
