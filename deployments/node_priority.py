"""CPU priority on the node `make serve` starts: the replicas that serve requests ahead of Ray's bookkeeping.

Ray runs its workers, Serve's replicas among them, at nice 15 (`RAY_worker_niceness`) and its own processes (GCS,
dashboard, log monitor, agents) at nice 0: on a node where the engines use every CPU, each wake-up of those
processes preempts an engine thread, and a step split across two threads waits at every operator for the one that
was preempted. On 2 CPUs the idle Ray node (about a fifth of one CPU: Serve's controller loop, the log monitor,
the dashboard, GCS) made a lone 256-token prefill on two threads 87-95 → 106-113 ms in process, and noise at the
engine's own niceness made it half again slower, at nice 19 7% (README: Where one stream's first token goes).

So the launcher starts Ray's workers at its own niceness (RAY_worker_niceness=0, unless set) and, once Serve is
up, raises to BACKGROUND_NICE the niceness of every thread of its node's processes that serve no request: GCS, the
dashboard and its subprocesses, the log monitor, the agents, Serve's controller, the `serve run` CLI and this
launcher, and Serve's proxy where the ingress replica answers HTTP itself. The raylet keeps its niceness, since
the workers it starts later (a restarted or added replica) inherit it; the replicas and idle workers keep theirs.
Only raising a niceness needs no privilege, so this works for any user; it changes nothing outside the processes
this launcher started. Linux only (threads are read from /proc); elsewhere it does nothing and says so.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

BACKGROUND_NICE = 19
NICE_ENV = "TOKENLINE_BACKGROUND_NICE"  # a niceness for Ray's bookkeeping processes, or `off`
WORKER_NICENESS_ENV = "RAY_worker_niceness"
# Ray workers name themselves `ray::<actor or task>`; these serve no request where the ingress answers HTTP.
CONTROL_ACTORS = ("ray::ServeController",)
PROXY_ACTOR = "ray::ProxyActor"
AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    cmdline: str


def background_nice(environ: dict[str, str] | None = None) -> int | None:
    """The niceness for Ray's bookkeeping (None: leave Ray's priorities as they are), from NICE_ENV."""
    value = (environ if environ is not None else os.environ).get(NICE_ENV, str(BACKGROUND_NICE)).strip().lower()
    if value in ("off", "none", "no", "false", ""):
        return None
    try:
        nice = int(value)
    except ValueError:
        raise ValueError(f"{NICE_ENV}={value!r}: a niceness from 0 to 19, or off") from None
    if not 0 <= nice <= 19:
        raise ValueError(f"{NICE_ENV}={value!r}: a niceness from 0 to 19, or off")
    return nice


def worker_niceness_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Before Ray starts: its workers (the replicas) at the launcher's own niceness, unless the user chose one."""
    environ = environ if environ is not None else os.environ
    return {} if WORKER_NICENESS_ENV in environ else {WORKER_NICENESS_ENV: "0"}


def descendants(procs: list[Proc], root: int) -> list[Proc]:
    children: dict[int, list[Proc]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p)
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child.pid)
    return found


def is_background(proc: Proc, proxy_serves: bool) -> bool:
    """Whether a process of the launcher's Ray node serves no request. Ray workers other than the controller, the
    agents and (unless it serves) the proxy are left alone: a replica, or an idle worker that may become one; so
    is the raylet, whose niceness the workers it starts inherit."""
    cmd = proc.cmdline
    if cmd.startswith("ray::"):
        if cmd.startswith(PROXY_ACTOR):
            return not proxy_serves
        return cmd.startswith(CONTROL_ACTORS + AGENTS)
    executable = cmd.split(" ", 1)[0]
    return Path(executable).name != "raylet"


def read_procs(proc_dir: str = "/proc") -> list[Proc]:
    procs = []
    for entry in os.listdir(proc_dir):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc_dir}/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
            with open(f"{proc_dir}/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or a kernel thread
        procs.append(Proc(int(entry), ppid, cmdline))
    return procs


def raise_nice(pid: int, nice: int, proc_dir: str = "/proc") -> int:
    """Every thread of `pid` to at least `nice` (on Linux a niceness is a thread's); the threads changed."""
    changed = 0
    try:
        tids = [int(t) for t in os.listdir(f"{proc_dir}/{pid}/task")]
    except OSError:
        return 0
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed += 1
        except OSError:  # the thread ended, or is not ours
            continue
    return changed


def lower_background(proxy_serves: bool, nice: int | None, root: int | None = None,
                     include_root: bool = True) -> list[Proc]:
    """Raises the niceness of the background processes below `root` (default: this process), and of `root`
    itself with `include_root` (the launcher; not a benchmark whose client runs in the process that started Ray);
    returns those it changed."""
    if nice is None:
        return []
    if not Path("/proc/self/task").is_dir():
        log.info("CPU priorities left as Ray sets them: no /proc to find its processes' threads on")
        return []
    root = os.getpid() if root is None else root
    procs = read_procs()
    mine = [p for p in procs if p.pid == root and include_root] + descendants(procs, root)
    return [p for p in mine if (p.pid == root or is_background(p, proxy_serves)) and raise_nice(p.pid, nice)]
