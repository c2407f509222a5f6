"""The ranks of one tensor-parallel engine: start-up rendezvous, the model's collectives, and the step channel.

Rank 0 (the engine's own process) schedules and samples; every step it broadcasts the step's inputs to the other
ranks as tensors, never pickled objects: one fixed-size int64 message holding an opcode, the step's sizes and, when
it fits (a decode batch of 64 with 4k-token contexts does), the packed inputs themselves; a larger step follows
with one more broadcast of exactly its size. Then every rank runs the same forward: an all-reduce after each
row-parallel layer and the embedding, a gather of the vocabulary-sharded logits to rank 0 at the end.

Collectives run on the device group (NCCL on CUDA, gloo on CPU); the step channel always on a gloo group (CPU
tensors: the inputs are built on the host). On CPU, with the native kernels, the model's all-reduces and the logits
gather go through a shared-memory region instead (engine/kernels/shm_collectives_cpu.cpp: microseconds where gloo
takes most of a millisecond); `shm_collectives: false` keeps them on gloo. Failures end the engine, never hang it: every collective has a
timeout (`collective_timeout_s`); a rank that dies closes its sockets and the peer's next collective raises at
once; while idle, rank 0 sends a heartbeat that every rank acknowledges, so that a rank that died or hangs is
found within seconds, and the other ranks, which wait for rank 0's next message under the same timeout, exit when
rank 0 goes silent.
"""
from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from engine.failures import EngineFatalError
from engine.step_inputs import NUM_SIZES, StepInputs

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 1800.0  # every rank loaded its weights (a large model read from a network volume is slow)
INLINE_NUMEL = 4096  # int64s of packed inputs carried in the fixed message itself
OP_STEP, OP_PING, OP_STOP = 1, 2, 3
HEADER = 1 + NUM_SIZES


class RankFailure(EngineFatalError):
    """A tensor-parallel rank is gone, failed or stopped answering: the engine cannot go on (fatal, not one
    batch's failure: every later step would need that rank)."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: rank 0's TCP store (on loopback: the ranks of one engine share a node)."""

    host: str
    port: int
    world_size: int


def create_store(world_size: int) -> tuple[dist.TCPStore, Rendezvous]:
    """Rank 0's store, on a port the OS picks (no race for a free port)."""
    host = "127.0.0.1"
    store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
                          wait_for_workers=False)
    return store, Rendezvous(host, store.port, world_size)


def join_store(rendezvous: Rendezvous) -> dist.TCPStore:
    return dist.TCPStore(rendezvous.host, rendezvous.port, rendezvous.world_size, is_master=False,
                         timeout=timedelta(seconds=STARTUP_TIMEOUT_S))


class SharedMemoryCollectives:
    """All-reduce and gather over a region every rank maps (engine/kernels/shm_collectives_cpu.cpp)."""

    SLOT_BYTES = 1 << 20  # per rank and parity: larger tensors go through in chunks

    def __init__(self, path: str, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.slot_elems = self.SLOT_BYTES // 4
        self.region = torch.from_file(path, shared=True, size=self.region_bytes(world_size), dtype=torch.uint8)
        torch.ops.tokenline.shm_register(self.region, rank, world_size, self.slot_elems)

    @classmethod
    def region_bytes(cls, world_size: int) -> int:
        return world_size * 64 + 2 * world_size * cls.SLOT_BYTES

    @classmethod
    def create(cls, world_size: int) -> str:
        """A zeroed region file in /dev/shm (rank 0); unlinked once every rank has mapped it."""
        fd, path = tempfile.mkstemp(prefix="tokenline-tp-", dir="/dev/shm")
        os.ftruncate(fd, cls.region_bytes(world_size))
        os.close(fd)
        return path

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        target = x if x.is_contiguous() else x.contiguous()
        torch.ops.tokenline.shm_all_reduce(target, self.region, self.rank, self.world_size, self.slot_elems,
                                           self.timeout_s)
        return target if target is x else x.copy_(target)

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        x = x.float().contiguous()
        out = torch.empty((self.world_size, *x.shape) if self.rank == 0 else (0,), dtype=torch.float32)
        torch.ops.tokenline.shm_gather(x, out, self.region, self.rank, self.world_size, self.slot_elems,
                                       self.timeout_s)
        return list(out) if self.rank == 0 else None


def shm_collectives_possible(device: torch.device) -> bool:
    if device.type != "cpu" or not os.path.isdir("/dev/shm"):
        return False
    from engine.kernels import cpu_kernels_available
    return cpu_kernels_available()


class TensorParallelGroup:
    def __init__(self, rank: int, world_size: int, store: dist.TCPStore, device: torch.device,
                 timeout_s: float, shm_collectives: bool = True) -> None:
        self.rank, self.world_size = rank, world_size
        self.store, self.device, self.timeout_s = store, device, timeout_s
        self.device_group = self.cpu_group = None
        self.shm: SharedMemoryCollectives | None = None
        self._want_shm = shm_collectives and shm_collectives_possible(device)
        self._shm_path = ""  # rank 0: the region's file until every rank has mapped it
        self.failure: RankFailure | None = None
        self.lock = threading.Lock()  # rank 0: one step or heartbeat on the wire at a time
        self._message = torch.zeros(HEADER + INLINE_NUMEL, dtype=torch.int64)
        self._last_sent = time.monotonic()
        self._heartbeat: threading.Thread | None = None
        self._stopped = threading.Event()

    # -- start-up ---------------------------------------------------------------------------------------------

    def report_failure(self, exc: BaseException) -> None:
        """A rank that cannot start says why, so that rank 0 fails with its reason instead of a timeout."""
        try:
            self.store.set(f"failed/{self.rank}", f"{type(exc).__name__}: {exc}"[:2000])
        except Exception:  # the store (rank 0) is gone too: nobody is left to tell
            pass

    def connect(self, check_peers: Callable[[], None] = lambda: None) -> None:
        """Waits until every rank has loaded its weights, then forms the process groups."""
        if self.rank == 0:
            self._shm_path = SharedMemoryCollectives.create(self.world_size) if self._want_shm else ""
            self.store.set("shm", self._shm_path)
        self.store.set(f"loaded/{self.rank}", "1")
        keys = [f"loaded/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            failed = [r for r in range(self.world_size) if self.store.check([f"failed/{r}"])]
            if failed:
                reason = self.store.get(f"failed/{failed[0]}").decode()
                raise RankFailure(f"tensor-parallel rank {failed[0]} failed to start: {reason}")
            check_peers()
            try:
                self.store.wait(keys, timedelta(seconds=1))
                break
            except (RuntimeError, dist.DistStoreError):  # not all there yet
                if time.monotonic() > deadline:
                    raise RankFailure(f"tensor-parallel ranks did not load their weights within "
                                      f"{STARTUP_TIMEOUT_S:.0f} s") from None
        if dist.is_initialized():
            raise RuntimeError("this process already holds a torch.distributed group: one tensor-parallel engine "
                               "per process (close the other engine first)")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks share a node: keep their sockets on loopback
        timeout = timedelta(seconds=self.timeout_s)
        cuda = self.device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.PrefixStore("tp", self.store),
                                rank=self.rank, world_size=self.world_size, timeout=timeout,
                                device_id=self.device if cuda else None)
        self.device_group = dist.group.WORLD
        self.cpu_group = dist.new_group(backend="gloo", timeout=timeout) if cuda else self.device_group
        self._map_shared_memory()
        log.info("tensor-parallel rank %d of %d connected (%s)", self.rank, self.world_size,
                 "shared memory" if self.shm else "NCCL" if cuda else "gloo")

    def _map_shared_memory(self) -> None:
        """Every rank maps rank 0's region, or none does (any rank without the kernels keeps all on gloo)."""
        path = self.store.get("shm").decode()
        mapped = None
        if path and self._want_shm:
            mapped = SharedMemoryCollectives(path, self.rank, self.world_size, self.timeout_s)
        everyone = self.min(int(mapped is not None))  # also: nobody unlinks before all have mapped
        self._unlink_region()
        self.shm = mapped if everyone else None

    def _unlink_region(self) -> None:
        if self._shm_path:
            Path(self._shm_path).unlink(missing_ok=True)
            self._shm_path = ""

    def close(self) -> None:
        self._unlink_region()
        self._stopped.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=self.timeout_s)
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- the model's collectives ------------------------------------------------------------------------------

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _failed(self, exc: Exception, what: str) -> RankFailure:
        self.failure = RankFailure(f"tensor-parallel {what} failed on rank {self.rank}: a rank is gone or stopped "
                                   f"answering ({exc})")
        return self.failure

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks, in place; every rank gets the same bits."""
        try:
            if self.shm is not None:
                return self.shm.all_reduce(x)
            dist.all_reduce(x, group=self.device_group)
        except RuntimeError as exc:
            raise self._failed(exc, "all-reduce") from exc
        return x

    def min(self, value: int) -> int:
        """The smallest of every rank's `value` (what all ranks can agree on: KV blocks, CUDA graphs)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x` (same shape everywhere), on rank 0; None on the others."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        try:
            if self.shm is not None:
                return self.shm.gather(x)
            dist.gather(x, parts, dst=0, group=self.device_group)
        except RuntimeError as exc:
            raise self._failed(exc, "gather") from exc
        return parts

    # -- the step channel -------------------------------------------------------------------------------------

    def send_step(self, step: StepInputs) -> None:
        """Rank 0, holding `lock`: the step's inputs to every other rank."""
        self._check()
        sizes = step.sizes
        flat = step.pack()
        self._send(OP_STEP, sizes, flat)

    def _send(self, op: int, sizes: list[int], flat: torch.Tensor | None = None) -> None:
        message = self._message
        message[0] = op
        message[1:HEADER] = torch.tensor(sizes, dtype=torch.int64)
        inline = flat is not None and flat.numel() <= INLINE_NUMEL
        if inline:
            message[HEADER:HEADER + flat.numel()] = flat
        try:
            dist.broadcast(message, src=0, group=self.cpu_group)
            if flat is not None and not inline:
                dist.broadcast(flat, src=0, group=self.cpu_group)
        except RuntimeError as exc:
            raise self._failed(exc, "step broadcast") from exc
        self._last_sent = time.monotonic()

    def receive(self) -> StepInputs | int:
        """Other ranks: the next step's inputs, or OP_PING (answered here) or OP_STOP."""
        message = self._message
        dist.broadcast(message, src=0, group=self.cpu_group)
        op = int(message[0])
        if op == OP_PING:
            self._acknowledge()
            return op
        if op != OP_STEP:
            return op
        sizes = message[1:HEADER].tolist()
        numel = StepInputs.packed_numel(sizes)
        if numel <= INLINE_NUMEL:
            flat = message[HEADER:HEADER + numel].clone()
        else:
            flat = torch.empty(numel, dtype=torch.int64)
            dist.broadcast(flat, src=0, group=self.cpu_group)
        return StepInputs.unpack(sizes, flat)

    def _acknowledge(self) -> None:
        dist.all_reduce(torch.ones(1, dtype=torch.int64), group=self.cpu_group)

    def stop_ranks(self) -> None:
        """Rank 0: tells the other ranks to leave their loop (they then close the group)."""
        if self.failure is not None or self.cpu_group is None:
            return
        with self.lock:
            try:
                self._send(OP_STOP, [0] * NUM_SIZES)
            except RankFailure:
                pass

    # -- rank 0's heartbeat -----------------------------------------------------------------------------------

    def start_heartbeat(self, check_peers: Callable[[], None]) -> None:
        """While no step runs for a while, rank 0 pings every rank (which waits under the collective timeout)."""
        interval = min(5.0, self.timeout_s / 4)

        def beat() -> None:
            while not self._stopped.wait(interval / 2):
                try:
                    check_peers()
                    if time.monotonic() - self._last_sent < interval or not self.lock.acquire(timeout=interval):
                        continue
                    try:
                        if self.failure is None and not self._stopped.is_set():
                            self._send(OP_PING, [0] * NUM_SIZES)
                            self._acknowledge()
                    finally:
                        self.lock.release()
                except RankFailure as exc:
                    self.failure = self.failure or exc
                except RuntimeError as exc:
                    self._failed(exc, "heartbeat")
                if self.failure is not None:
                    log.error("%s", self.failure)
                    return

        self._heartbeat = threading.Thread(target=beat, name="tp-heartbeat", daemon=True)
        self._heartbeat.start()
