"""Transparent huge pages under a CPU engine's weights and KV cache.

A decode step streams every weight once (270 MB of bf16 for SmolLM2-135M) and reads the KV cache of every running
sequence; on 4 KiB pages that is ~66,000 page-table walks a step for the weights alone. Linux backs anonymous memory
with 2 MiB pages only where asked (`/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` on most
distributions), and glibc's allocations are not asked. After loading, the engine asks the kernel to rebuild the
2 MiB frames its large tensors fill on huge pages (MADV_COLLAPSE, Linux 6.1+), from a thread of its own, so that
the engine serves meanwhile (on a VM whose free memory goes back to the host, each fresh huge page costs a host
fault: 6-10 s for 1 GiB on our CI machines, 0.1-0.2 s where the memory is backed); where the kernel refuses (older,
THP off, no free huge page) the frames stay as they were and the engine runs as before. Measured on the EPYC, two
threads, in process (`python -m benchmarks.huge_pages`): decode steps at batch 1 and 32 0.98x the time on 4 KiB
pages stepped in turn with them, 0.91-0.92x in blocks of a round; a lone 256-token prefill 0.99x.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

MADV_COLLAPSE = 25
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
THP_PMD_SIZE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"
# A frame is collapsed only where tensors fill at least this share of it: collapsing makes every page of the frame
# resident, so a frame mostly outside them would cost memory for nothing.
MIN_FILL = 0.5
COLLAPSE_TRIES = 5


def _load_malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_MALLOC_TRIM = _load_malloc_trim()


def release_free_heap() -> None:
    """glibc keeps freed memory in its arenas (most tensors of a small model are below its mmap threshold) until
    asked to hand it back: after a burst of requests of varied shapes that is hundreds of MB of RSS the process no
    longer uses (measured: 1.6 GB back to 1.2 GB per SmolLM2 replica after 600 requests), after loading the plain
    weights that packed copies replaced."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@dataclass
class HugePageReport:
    frames: int = 0  # 2 MiB frames the tensors fill (MIN_FILL or more)
    collapsed: int = 0  # of them, now on a huge page
    frame_bytes: int = 0
    reason: str = ""  # why none could be, where none was


def thp_mode(path: str = THP_ENABLED) -> str | None:
    """The system's THP mode ("always", "madvise", "never"), None where the kernel has none."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def huge_page_size(path: str = THP_PMD_SIZE) -> int:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


def tensor_frames(tensors: Iterable[torch.Tensor], frame_bytes: int, min_fill: float = MIN_FILL) -> list[int]:
    """Start addresses of the frames (aligned, `frame_bytes` long) that the tensors' storages fill at least
    `min_fill` of, each counted once however many tensors share a storage."""
    spans = {}
    for t in tensors:
        if t is None or t.device.type != "cpu" or t.layout != torch.strided:
            continue  # oneDNN's opaque tensors (a prepacked weight on a Xeon's AMX path) expose no storage
        storage = t.untyped_storage()
        if storage.nbytes():
            spans[storage.data_ptr()] = storage.nbytes()
    filled: dict[int, int] = {}
    for start, size in spans.items():
        end = start + size
        frame = start - start % frame_bytes
        while frame < end:
            filled[frame] = filled.get(frame, 0) + min(end, frame + frame_bytes) - max(start, frame)
            frame += frame_bytes
    return sorted(f for f, n in filled.items() if n >= min_fill * frame_bytes)


def collapse(tensors: Iterable[torch.Tensor]) -> HugePageReport:
    """Rebuild the frames these CPU tensors fill on huge pages (MADV_COLLAPSE), frame by frame; what the kernel
    refuses stays as it was. The tensors' contents do not change (the kernel's collapse is safe on live memory:
    an access meanwhile waits on the frame's page table)."""
    report, frames = plan(tensors)
    return run(report, frames)


def plan(tensors: Iterable[torch.Tensor]) -> tuple[HugePageReport, list[int]]:
    frame_bytes = huge_page_size()
    report = HugePageReport(frame_bytes=frame_bytes)
    mode = thp_mode()
    if mode in (None, "never"):
        report.reason = "transparent huge pages are off in this kernel" if mode else "no transparent huge pages here"
        return report, []
    frames = tensor_frames(tensors, frame_bytes)
    report.frames = len(frames)
    return report, frames


def _collapse_frame(libc, frame: int, frame_bytes: int) -> int:
    """MADV_COLLAPSE on one frame: 0, or the errno of its last try. EINVAL: not within one mapping (or a kernel
    before 6.1); ENOMEM: no free huge page; EAGAIN: a page of it was busy, as when engines in two processes collapse
    the one shared copy of their weights (engine.shared_weights) at once: tried again a little later."""
    for attempt in range(COLLAPSE_TRIES):
        if libc.madvise(frame, frame_bytes, MADV_COLLAPSE) == 0:
            return 0
        code = ctypes.get_errno()
        if code != errno.EAGAIN:
            return code
        time.sleep(0.01 * (attempt + 1))
    return errno.EAGAIN


def run(report: HugePageReport, frames: list[int]) -> HugePageReport:
    frame_bytes = report.frame_bytes
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    errors: dict[int, int] = {}
    for frame in frames:
        code = _collapse_frame(libc, frame, frame_bytes)
        if code == 0:
            report.collapsed += 1
        else:
            errors[code] = errors.get(code, 0) + 1
    if errors:
        report.reason = ", ".join(f"{n} frame(s): {os.strerror(code)}" for code, n in sorted(errors.items()))
    return report


class BackgroundCollapse:
    """collapse() on a daemon thread (ctypes lets go of the GIL in each madvise): `report` fills in as it goes,
    `join()` waits for the end. The caller keeps the tensors alive (a frame freed meanwhile is refused, harmlessly)."""

    def __init__(self, tensors: Iterable[torch.Tensor], on_done=None) -> None:
        self.report, frames = plan(tensors)
        self.started = time.perf_counter()
        self.seconds: float | None = None
        self._on_done = on_done
        self._thread = threading.Thread(target=self._run, args=(frames,), name="huge-pages", daemon=True)
        self._thread.start()

    def _run(self, frames: list[int]) -> None:
        try:  # behind the engine's threads (nice 19, this thread alone): the copies wait while a step runs
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
        run(self.report, frames)
        self.seconds = time.perf_counter() - self.started
        if self._on_done is not None:
            self._on_done(self)

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors a module's steps read: its parameters and buffers, and the tensors its submodules hold as plain
    attributes (prepacked weights, int8 weights and scales), less the weights a prepacked copy stands in for."""
    out: list[torch.Tensor] = []
    for sub in module.modules():
        packed = getattr(sub, "packed", None) is not None
        out += [p for name, p in sub.named_parameters(recurse=False) if not (packed and name == "weight")]
        out += list(sub.buffers(recurse=False))
        out += [v for v in vars(sub).values() if isinstance(v, torch.Tensor)]
    return out
