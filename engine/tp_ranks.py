"""The ranks of a tensor-parallel engine other than rank 0: what each runs (`run_rank`), and how they start.

An engine on its own starts them as local processes (`LocalRanks`, torch.multiprocessing's spawn); an engine
replica on Ray passes its own launcher (deployments/tp_ranks.py: actors in the replica's placement group). Either
way rank 0 asks `check()` for the ranks' liveness, and `stop()` ends them.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.config import EngineConfig, default_num_threads
from engine.loader import open_checkpoint
from engine.tp_group import OP_STOP, RankFailure, Rendezvous, TensorParallelGroup, join_store

log = logging.getLogger(__name__)

PARENT_POLL_S = 1.0


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to start: the engine's config, its place, and where the ranks meet."""

    config: EngineConfig
    rank: int
    rendezvous: Rendezvous
    device: str  # e.g. "cpu", "cuda:1", or "cuda" where the process sees only its own GPU


class RankLauncher(Protocol):
    def device(self, rank: int, config: EngineConfig) -> str:
        """The device rank `rank` runs on, as that rank's process names it."""

    def start(self, specs: list[RankSpec]) -> None:
        """Starts ranks 1..N-1 (returns at once; `run_rank` does the rest)."""

    def check(self) -> None:
        """Raises RankFailure if a started rank has ended."""

    def stop(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` for the ranks to leave after OP_STOP, then ends the ones left."""


def rank_threads(config: EngineConfig) -> int:
    """torch threads of each rank: as configured, else this process's CPUs shared among the ranks (local
    processes share the CPUs of the engine's own process)."""
    return config.num_threads or max(1, default_num_threads() // config.tensor_parallel_size)


def run_rank(spec: RankSpec) -> None:
    """A rank's whole life: load its shard, connect, then run every step rank 0 sends until it says stop."""
    from engine.model_shard import ModelShard

    config = spec.config
    torch.set_num_threads(rank_threads(config))
    torch.manual_seed(config.seed)
    group = TensorParallelGroup(spec.rank, config.tensor_parallel_size, join_store(spec.rendezvous),
                                torch.device(spec.device), config.collective_timeout_s,
                                config.shm_collectives)
    try:
        args, weights = open_checkpoint(config.model)
        shard = ModelShard(config, args, weights, config.model_len(args), group, spec.device)
        log.info("tensor-parallel rank %d ready: %d KV blocks, %d torch threads", spec.rank, shard.num_blocks,
                 torch.get_num_threads())
        while True:
            message = group.receive()
            if message == OP_STOP:
                break
            if not isinstance(message, int):
                shard.run(message)
        shard.release_weights()
    except BaseException as exc:
        group.report_failure(exc)
        raise
    finally:
        group.close()


def _watch_parent(parent: int) -> None:
    """A local rank outlives no engine: when the process that started it is gone, it goes too."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def _local_rank_main(spec: RankSpec, parent: int) -> None:
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    logging.basicConfig(level=logging.INFO, format=f"[rank {spec.rank}] %(levelname)s %(name)s: %(message)s")
    run_rank(spec)


class LocalRanks:
    """Ranks 1..N-1 as child processes of this one (spawned: a forked CUDA or OpenMP runtime is unsafe)."""

    def __init__(self) -> None:
        self.processes: list = []

    def device(self, rank: int, config: EngineConfig) -> str:
        device = torch.device(config.device)
        if device.type == "cuda" and device.index is None:
            return f"cuda:{rank}"
        return str(device)

    def start(self, specs: list[RankSpec]) -> None:
        context = torch.multiprocessing.get_context("spawn")
        for spec in specs:
            process = context.Process(target=_local_rank_main, args=(spec, os.getpid()), daemon=True,
                                      name=f"tokenline-rank-{spec.rank}")
            process.start()
            self.processes.append(process)

    def check(self) -> None:
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                raise RankFailure(f"tensor-parallel rank {rank} (pid {process.pid}) exited with code "
                                  f"{process.exitcode}")

    def stop(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5.0)
        self.processes.clear()

