"""How many of this process's CPUs other processes left idle lately, from /proc/stat: for a CPU engine replica that
may lend a lone prefill the cores its neighbours are not using.

A replica is given CPUs (Ray's `num_cpus`, one torch thread each); on a node where the other replicas and the
serving processes are idle, a long prefill alone in its step runs about 1.7x faster on two threads (256 tokens of
SmolLM2 here: 173 → 100 ms). Whether they are idle is read from the kernel's per-CPU idle time over the CPUs this
process may run on (`os.sched_getaffinity`), since the last read, plus this process's own CPU time over the same
window (what it used, it could use again). It reads the whole machine, not a container's CPU
quota: where a replica's CPUs are limited by a quota rather than a CPU set, leave `prefill_threads` unset.

A window of the past misjudges the moment load moves from one replica to another: with one stream and two
replicas, the prefill of a request that lands on the replica idle until now reads a window in which its neighbour
was decoding the last request, though the neighbour has just gone idle. So the engines on a node tell each other
what they run on now (`EngineBoard`: a file per engine process holding its torch threads, 0 while it has nothing
to do), and the reading counts each such neighbour at its use now instead of its use over the window.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path

# Shorter than this since the last read says too little: /proc/stat counts in clock ticks (10 ms).
MIN_WINDOW_S = 0.1
# Where the engines of this node (of this user) write what they run on; overridden by this variable.
BOARD_DIR_ENV = "TOKENLINE_ENGINE_BOARD"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def default_board_dir() -> Path:
    if os.environ.get(BOARD_DIR_ENV):
        return Path(os.environ[BOARD_DIR_ENV])
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"tokenline-engines-{os.getuid()}"


def process_cpu_s(pid: int, proc: str = "/proc") -> float | None:
    """A process's user + system CPU seconds so far, from /proc/PID/stat; None where it cannot be read."""
    try:
        with open(f"{proc}/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # the name may hold spaces: skip past it
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14 and 15)
    except (OSError, ValueError, IndexError):
        return None


class EngineBoard:
    """The CPU engines on this node say what they run on now: one file per engine process, named after its pid,
    holding its torch threads (0 while it has nothing to do), rewritten only when that changes (so at most twice a
    step, and only on steps that change it)."""

    def __init__(self, directory: Path | None = None, pid: int | None = None) -> None:
        self.pid = pid if pid is not None else os.getpid()
        self.dir: Path | None = directory if directory is not None else default_board_dir()
        self._threads: int | None = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            self.dir = None

    def publish(self, threads: int) -> None:
        if threads == self._threads or self.dir is None:
            return
        self._threads = threads
        try:
            tmp = self.dir / f".{self.pid}.tmp"
            tmp.write_text(str(threads))
            os.replace(tmp, self.dir / str(self.pid))  # whole: a reader never sees half a write
        except OSError:
            pass

    def others(self) -> dict[int, int]:
        """The other live engines' threads now, by pid. A file whose process has gone is removed."""
        found: dict[int, int] = {}
        if self.dir is None:
            return found
        try:
            entries = list(os.scandir(self.dir))
        except OSError:
            return found
        for entry in entries:
            if not entry.name.isdigit() or int(entry.name) == self.pid:
                continue
            pid = int(entry.name)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                continue
            except PermissionError:
                pass  # alive, another user's
            try:
                with open(entry.path) as f:
                    found[pid] = int(f.read() or 0)
            except (OSError, ValueError):
                continue
        return found

    def close(self) -> None:
        if self.dir is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.dir / str(self.pid))
        self._threads = None


class IdleCpus:
    def __init__(self, stat_path: str = "/proc/stat", board: EngineBoard | None = None, proc: str = "/proc") -> None:
        self.stat_path = stat_path
        self.board, self.proc = board, proc
        try:
            self.cpus = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        except (AttributeError, OSError):
            self.cpus = set()
        self._last = self._read()
        self._last_at = time.monotonic()
        self._own_last = time.process_time()
        self._idle = 0.0
        # The neighbours on the board: CPU seconds at the last read, and what they used over its window.
        self._others_cpu: dict[int, float] = self._others_cpu_now(self.board.others() if self.board else {})
        self._others_used = 0.0

    def _others_cpu_now(self, others: dict[int, int]) -> dict[int, float]:
        found = {pid: process_cpu_s(pid, self.proc) for pid in others}
        return {pid: cpu for pid, cpu in found.items() if cpu is not None}

    def _read(self) -> tuple[int, int] | None:
        """(idle ticks, all ticks) summed over this process's CPUs; None where /proc/stat cannot be read."""
        try:
            with open(self.stat_path) as f:
                idle = total = 0
                for line in f:
                    name, _, rest = line.partition(" ")
                    if name in self.cpus:
                        ticks = [int(v) for v in rest.split()]
                        idle += ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
                        total += sum(ticks[:8])  # user..steal; guest time is inside user already
                return (idle, total) if total else None
        except (OSError, ValueError, IndexError):
            return None

    def idle(self) -> float:
        """CPUs this process could have now (0 to the number of CPUs): those left idle on average since the last
        call, plus those this process itself kept busy (a step that borrowed does not read its own use as its
        neighbours'), with each engine on the board counted at what it runs on now instead of what it used. The
        window is kept when called again within MIN_WINDOW_S; 0 where /proc/stat cannot be read."""
        now = time.monotonic()
        others = self.board.others() if self.board is not None else {}
        if now - self._last_at >= MIN_WINDOW_S:
            self._read_window(now, others)
        return max(0.0, min(float(len(self.cpus)), self._idle + self._others_used - sum(others.values())))

    def _read_window(self, now: float, others: dict[int, int]) -> None:
        current, own, others_cpu = self._read(), time.process_time(), self._others_cpu_now(others)
        window = now - self._last_at
        if current is not None and self._last is not None and current[1] > self._last[1]:
            idle_ticks, all_ticks = current[0] - self._last[0], current[1] - self._last[1]
            self._idle = len(self.cpus) * idle_ticks / all_ticks + (own - self._own_last) / window
            # A neighbour seen for the first time counts as having used nothing over the window.
            self._others_used = sum(cpu - self._others_cpu.get(pid, cpu) for pid, cpu in others_cpu.items()) / window
        self._last, self._last_at, self._own_last, self._others_cpu = current, now, own, others_cpu
