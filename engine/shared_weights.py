"""One copy of the packed linear weights for every CPU engine on a node.

Each engine replica packs its linears' weights for the native kernel (engine.models.layers.Linear.prepack), and a
decode step streams all of them from memory: 256 MiB for SmolLM2-135M in bf16. Replicas on one node (`make serve`
runs one per CPU) each held their own copy. Here the first replica to pack a model writes the packed tensors to a
file in shared memory (/dev/shm) and every replica of the model on the node, itself included, maps that file and
drops its private copy: one copy in RAM however many replicas, each replica's proportional share of memory (PSS)
256 MiB / N instead of 256 MiB. Measured on the EPYC (`python -m benchmarks.shared_weights --rounds 3`: two engines
decoding at once): PSS 1,284 against 1,358 MiB a process; decode steps at 1 / 4 / 16 rows 1.05x / 0.96x / 1.00x the
time with a copy each, the shared copy's steps steady where the private copies' swung between rounds (8.3-11.7 ms
at one row against 8.9-9.2), and through `make serve` level within noise (README).

The file is named by the SHA-256 of the packed bytes, so a replica maps only a file whose contents are exactly what
it packed itself. Every replica holds a shared lock (flock) on the file it maps; the last one to let go unlinks it.
A replica that dies without letting go (SIGKILL) leaves the file behind, and the next engine that starts on the
node sweeps every file no process holds. Where the directory is missing, not writable or full, the engine keeps
its private copy and says why.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import functools
import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.huge_pages import release_free_heap

log = logging.getLogger(__name__)

PREFIX = "tokenline-weights-"
SUFFIX = ".bin"
LOCK_NAME = "tokenline-weights.lock"  # held while a file is swept or written, so none is swept half-written
MAGIC = b"TLWEIGHT"
HEADER = struct.Struct("<8sQ")  # magic, length of the JSON index that follows
ALIGN = 4096  # each tensor starts on a page
DATA_ALIGN = 2 << 20  # the first tensor starts on a 2 MiB boundary of the file, mapped on one of memory
MAP_FIXED = 0x10
DEFAULT_DIR = "/dev/shm"
PACKED_FIELDS = ("packed", "packed_int8", "scales")  # Linear's tensors that a step streams


@dataclass
class ShareReport:
    path: str | None = None
    bytes: int = 0
    tensors: int = 0
    created: bool = False  # this engine wrote the file (the first on the node)
    seconds: float = 0.0
    reason: str = ""  # why the weights stayed private, where they did


def default_dir() -> str | None:
    """/dev/shm where it is a writable directory, else None (the engine keeps private weights)."""
    return DEFAULT_DIR if os.path.isdir(DEFAULT_DIR) and os.access(DEFAULT_DIR, os.W_OK) else None


def packed_tensors(model: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """(module name, field, tensor) of every natively packed linear's streamed tensors, in module order."""
    from engine.models.layers import Linear

    found = []
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.packing not in ("native", "native-int8"):
            continue
        for field in PACKED_FIELDS:
            t = getattr(module, field)
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided:
                found.append((name, field, t.contiguous()))
    return found


def _index(tensors: list[tuple[str, str, torch.Tensor]]) -> tuple[list[dict], int]:
    entries, offset = [], 0
    for name, field, t in tensors:
        nbytes = t.numel() * t.element_size()
        entries.append({"module": name, "field": field, "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape), "offset": offset, "nbytes": nbytes})
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


def _data_start(index_len: int) -> int:
    """Where the tensors start: past the header and index, on the next 2 MiB boundary."""
    return -(-(HEADER.size + index_len) // DATA_ALIGN) * DATA_ALIGN


def _key(entries: list[dict], tensors: list[tuple[str, str, torch.Tensor]]) -> str:
    digest = hashlib.sha256(json.dumps(entries, sort_keys=True).encode())
    for _, _, t in tensors:
        digest.update(_raw(t))
    return digest.hexdigest()[:32]


_holding = threading.local()  # this thread's node locks: a finalizer run by the GC inside one must not wait on it


@contextmanager
def _node_lock(directory: Path) -> Iterator[None]:
    held = getattr(_holding, "dirs", None)
    if held is None:
        held = _holding.dirs = set()
    key = str(directory)
    if key in held:
        yield
        return
    fd = os.open(directory / LOCK_NAME, os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        held.add(key)
        yield
    finally:
        held.discard(key)
        os.close(fd)


def _unlink_if_unused(path: Path) -> bool:
    """Unlinks `path` where no process holds a lock on it. True where it did."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    try:
        path.unlink()
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def sweep(directory: str | Path) -> list[str]:
    """Unlinks every weights file in `directory` that no process holds (left by one that died) and any half-written
    one; call under the node lock. Returns the names it removed."""
    removed = []
    for path in sorted(Path(directory).glob(f"{PREFIX}*{SUFFIX}")):
        if _unlink_if_unused(path):
            removed.append(path.name)
    for path in Path(directory).glob(f".{PREFIX}*"):  # a writer holds the node lock: these are leftovers
        try:
            path.unlink()
            removed.append(path.name)
        except OSError:
            pass
    return removed


def _release(fd: int, path: str) -> None:
    """Lets go of the file and unlinks it where no other process holds it (safe while it is still mapped: the
    mapping keeps its memory until it goes). Under the node lock, so that no engine is between opening the file and
    locking it."""
    try:
        with _node_lock(Path(path).parent):
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            _unlink_if_unused(Path(path))
    except OSError:
        pass


class SharedWeights:
    """This process's shared lock on one weights file (its tensors hold the mapping); `release()` (or the
    interpreter's exit) lets go of it and unlinks the file where this was its last holder."""

    def __init__(self, fd: int, path: Path, report: ShareReport) -> None:
        self.path, self.report = path, report
        self._finalizer = weakref.finalize(self, _release, fd, str(path))

    def release(self) -> None:
        self._finalizer()


def _write(directory: Path, path: Path, entries: list[dict], data_bytes: int,
           tensors: list[tuple[str, str, torch.Tensor]]) -> int:
    """Writes the file under a temporary name, holding a shared lock from the start, and renames it into place.
    Returns the open, locked descriptor."""
    index = json.dumps({"tensors": entries}).encode()
    head = HEADER.pack(MAGIC, len(index)) + index
    data_start = _data_start(len(index))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{PREFIX}")
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        with os.fdopen(os.dup(fd), "wb", buffering=0) as f:
            f.write(head + bytes(data_start - len(head)))
            for entry, (_, _, t) in zip(entries, tensors):
                f.seek(data_start + entry["offset"])
                f.write(_raw(t))
            f.truncate(data_start + data_bytes)
        os.fchmod(fd, 0o644)
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return fd


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _map_aligned(fd: int, size: int) -> ctypes.Array:
    """The whole file mapped read-only and shared at an address on a 2 MiB boundary, so that the kernel can map its
    2 MiB-aligned frames on huge pages (engine.huge_pages; Python's mmap picks page-aligned addresses only). The
    mapping goes when the last tensor viewing it does."""
    libc = _libc()
    failed = ctypes.c_void_p(-1).value
    base = libc.mmap(None, size + DATA_ALIGN, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if base in (None, failed):
        raise OSError(ctypes.get_errno(), "mmap")
    addr = -(-base // DATA_ALIGN) * DATA_ALIGN
    if libc.mmap(addr, size, mmap.PROT_READ, mmap.MAP_SHARED | MAP_FIXED, fd, 0) != addr:
        code = ctypes.get_errno()
        libc.munmap(base, size + DATA_ALIGN)
        raise OSError(code, "mmap")
    if addr > base:  # the reservation's slack either side
        libc.munmap(base, addr - base)
    if base + DATA_ALIGN > addr:
        libc.munmap(addr + size, base + DATA_ALIGN - addr)
    view = (ctypes.c_char * size).from_address(addr)
    weakref.finalize(view, libc.munmap, addr, size)
    return view


def _map(fd: int, entries: list[dict]) -> list[torch.Tensor]:
    """Maps the file read-only, checks its index against ours, and returns views of its tensors."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, HEADER.size, 0)
    magic, index_len = HEADER.unpack(head) if len(head) == HEADER.size else (b"", 0)
    found = json.loads(os.pread(fd, index_len, HEADER.size))["tensors"] if magic == MAGIC else None
    data_start = _data_start(index_len)
    if found != entries or data_start + entries[-1]["offset"] + entries[-1]["nbytes"] > size:
        raise ValueError("its index does not match this model's packed weights")
    buffer = _map_aligned(fd, size)
    views = []
    with warnings.catch_warnings():  # the mapping is read-only on purpose: no kernel writes a weight
        warnings.simplefilter("ignore", UserWarning)
        for entry in entries:
            dtype = getattr(torch, entry["dtype"])
            count = entry["nbytes"] // dtype.itemsize
            t = torch.frombuffer(buffer, dtype=dtype, count=count, offset=data_start + entry["offset"])
            views.append(t.view(entry["shape"]))
    return views


def share_packed_weights(model: nn.Module, directory: str | Path) -> tuple[SharedWeights | None, ShareReport]:
    """Moves the model's natively packed linear weights onto the node's shared copy (writing it where this is the
    first engine of the model on the node). Returns the handle to keep (None where they stayed private) and a
    report."""
    start = time.perf_counter()
    report = ShareReport()
    tensors = packed_tensors(model)
    if not tensors:
        report.reason = "no natively packed linears"
        return None, report
    directory = Path(directory)
    entries, data_bytes = _index(tensors)
    path = directory / f"{PREFIX}{_key(entries, tensors)}{SUFFIX}"
    report.path, report.bytes, report.tensors = str(path), data_bytes, len(tensors)
    fd = None
    try:
        with _node_lock(directory):
            swept = sweep(directory)
            if swept:
                log.info("removed %d weights file(s) no engine holds from %s", len(swept), directory)
            try:
                fd = os.open(path, os.O_RDONLY)
                fcntl.flock(fd, fcntl.LOCK_SH)
            except FileNotFoundError:
                fd = _write(directory, path, entries, data_bytes, tensors)
                report.created = True
        views = _map(fd, entries)
    except (OSError, ValueError) as exc:
        if fd is not None:
            _release(fd, str(path))
        report.reason = f"{directory}: {os.strerror(exc.errno) if isinstance(exc, OSError) and exc.errno else exc}"
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            report.reason += f" (the weights need {data_bytes >> 20} MiB there)"
        report.seconds = time.perf_counter() - start
        return None, report
    modules = dict(model.named_modules())
    for (name, field, _), view in zip(tensors, views):
        setattr(modules[name], field, view)
    del tensors
    release_free_heap()  # the private copies' memory back to the system
    report.seconds = time.perf_counter() - start
    return SharedWeights(fd, path, report), report
