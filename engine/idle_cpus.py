"""How many of this process's CPUs other processes left idle lately, from /proc/stat: for a CPU engine replica that
may lend a lone prefill the cores its neighbours are not using.

A replica is given CPUs (Ray's `num_cpus`, one torch thread each); on a node where the other replicas and the
serving processes are idle, a long prefill alone in its step runs about 1.7x faster on two threads (256 tokens of
SmolLM2 here: 173 → 100 ms). Whether they are idle is read from the kernel's per-CPU idle time over the CPUs this
process may run on (`os.sched_getaffinity`), since the last read, plus this process's own CPU time over the same
window (what it used, it could use again). It reads the whole machine, not a container's CPU
quota: where a replica's CPUs are limited by a quota rather than a CPU set, leave `prefill_threads` unset.
"""
from __future__ import annotations

import os
import time

# Shorter than this since the last read says too little: /proc/stat counts in clock ticks (10 ms).
MIN_WINDOW_S = 0.1


class IdleCpus:
    def __init__(self, stat_path: str = "/proc/stat") -> None:
        self.stat_path = stat_path
        try:
            self.cpus = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        except (AttributeError, OSError):
            self.cpus = set()
        self._last = self._read()
        self._last_at = time.monotonic()
        self._own_last = time.process_time()
        self._idle = 0.0

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
        """CPUs this process could have had on average since the last call (0 to the number of CPUs): the idle
        ones plus those this process itself kept busy, so that a step that borrowed does not read its own use as
        its neighbours'. The last figure when called again within MIN_WINDOW_S, 0 where it cannot be read."""
        now = time.monotonic()
        if now - self._last_at < MIN_WINDOW_S:
            return self._idle
        current, own = self._read(), time.process_time()
        if current is None or self._last is None or current[1] <= self._last[1]:
            self._last, self._last_at, self._own_last = current, now, own
            return self._idle
        idle_ticks, all_ticks = current[0] - self._last[0], current[1] - self._last[1]
        n = len(self.cpus)
        own_cpus = (own - self._own_last) / (now - self._last_at)
        self._idle = min(float(n), n * idle_ticks / all_ticks + own_cpus)
        self._last, self._last_at, self._own_last = current, now, own
        return self._idle
