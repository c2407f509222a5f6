"""Where a served level's CPU goes: the CPU time of each process on the machine over the level, by role.

On a machine where the engine shares its cores with everything else a server runs (the ingress, Serve's controller
and proxy, Ray's GCS, raylet and dashboard agent) and with the load client, the served engine gets what the rest
leaves it. bench-peers reads every process's CPU time (`/proc/PID/stat`, user + system) when a level's client starts
and when it ends, sorts the processes by role (`role`), and reports each role's CPU per output token over the
client's run. The client itself (`vllm bench serve`, a child of the benchmark that has
exited by then) comes from the benchmark's children's resource usage; its figure includes its own start-up.
"""
from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TICKS_PER_S = os.sysconf("SC_CLK_TCK")  # the unit of /proc/PID/stat's times
CLIENT = "client"
# (role, any of these in the process's command line or name), first match wins
ROLES = (
    ("engine replica", ("EngineReplica",)),
    ("ingress", ("OpenAIIngress",)),
    ("Serve proxy", ("ProxyActor",)),
    ("Serve controller", ("ServeController",)),
    ("vLLM worker", ("VLLM::Worker",)),  # the model's forward passes
    ("vLLM engine core", ("VLLM::EngineCor",)),  # the scheduler's process (its name cut at 15 characters)
    ("vLLM API server", ("vllm serve", "vllm.entrypoints")),
    ("Ray GCS", ("gcs_server",)),
    ("raylet", ("raylet",)),
    ("Ray dashboard", ("DashboardAgent", "dashboard/dashboard.py", "dashboard/agent.py")),
    ("Ray other", ("ray/", "ray::")),
    ("serve run", ("serve run", "serve_run")),
)
OTHER = "other"


@dataclass(frozen=True)
class ProcessTime:
    comm: str
    cmdline: str
    cpu_s: float


def role(comm: str, cmdline: str) -> str:
    """The role a process plays in a served level, from its name and command line (OTHER where none fits)."""
    text = f"{comm} {cmdline}"
    for name, marks in ROLES:
        if any(mark in text for mark in marks):
            return name
    return OTHER


def read_stat(stat: str) -> tuple[str, float]:
    """(name, user + system CPU seconds) from the text of /proc/PID/stat."""
    comm = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    return comm, (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime, stime: fields 14 and 15 of stat


def snapshot(proc: Path = PROC, exclude: frozenset[int] = frozenset()) -> dict[int, ProcessTime]:
    """Every process's CPU time now (those that vanish while read are left out), but `exclude`'s; none where there
    is no /proc to read (not Linux)."""
    out: dict[int, ProcessTime] = {}
    if not proc.is_dir():
        return out
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) in exclude:
            continue
        try:
            comm, cpu_s = read_stat((entry / "stat").read_text())
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue
        out[int(entry.name)] = ProcessTime(comm, cmdline, cpu_s)
    return out


def children_cpu_s() -> float:
    """CPU seconds of this process's children that have exited and been waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_by_role(before: dict[int, ProcessTime], after: dict[int, ProcessTime]) -> dict[str, float]:
    """CPU seconds each role spent between two snapshots: the processes in both (a process started in between
    counts from zero)."""
    out: dict[str, float] = {}
    for pid, now in after.items():
        then = before.get(pid)
        spent = now.cpu_s - (then.cpu_s if then is not None else 0.0)
        if spent > 0:
            key = role(now.comm, now.cmdline)
            out[key] = out.get(key, 0.0) + spent
    return out


class LevelCPU:
    """Brackets one level's client run: `start()` before it, `stop()` after it returns each role's CPU seconds
    over the run, the client's (this process's children that exited meanwhile) under CLIENT."""

    def __init__(self, proc: Path = PROC) -> None:
        self.proc = proc

    def start(self) -> None:
        self._children = children_cpu_s()
        self._before = snapshot(self.proc, frozenset({os.getpid()}))

    def stop(self) -> dict[str, float]:
        spent = cpu_by_role(self._before, snapshot(self.proc, frozenset({os.getpid()})))
        client = children_cpu_s() - self._children
        if client > 0:
            spent[CLIENT] = spent.get(CLIENT, 0.0) + client
        return spent


def per_token_ms(spent: dict[str, float], tokens: int) -> dict[str, float]:
    """Each role's CPU milliseconds per output token."""
    if tokens <= 0:
        return {}
    return {k: v * 1e3 / tokens for k, v in spent.items()}
