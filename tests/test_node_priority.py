"""`make serve` lowers the CPU priority of its Ray node's bookkeeping below the replicas'."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deployments.node_priority import (BACKGROUND_NICE, Proc, background_nice, descendants, is_background,
                                       lower_background, read_procs, worker_niceness_env)

linux_only = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads threads from /proc")
RAY = "/venv/lib/python3.11/site-packages/ray"


def test_the_background_niceness_defaults_to_19_and_can_be_turned_off_or_chosen():
    assert background_nice({}) == BACKGROUND_NICE == 19
    assert background_nice({"TOKENLINE_BACKGROUND_NICE": "off"}) is None
    assert background_nice({"TOKENLINE_BACKGROUND_NICE": " 10 "}) == 10
    for bad in ("-1", "20", "high"):
        with pytest.raises(ValueError, match="TOKENLINE_BACKGROUND_NICE"):
            background_nice({"TOKENLINE_BACKGROUND_NICE": bad})


def test_workers_start_at_the_launchers_niceness_unless_the_user_chose_one():
    assert worker_niceness_env({}) == {"RAY_worker_niceness": "0"}
    assert worker_niceness_env({"RAY_worker_niceness": "5"}) == {}


@pytest.mark.parametrize("cmdline, proxy_serves, background", [
    (f"{RAY}/core/src/ray/gcs/gcs_server --log_dir=/tmp/ray", False, True),
    (f"/venv/bin/python -u {RAY}/_private/log_monitor.py --session-dir=/tmp/ray", False, True),
    (f"/venv/bin/python {RAY}/dashboard/dashboard.py --host=127.0.0.1", False, True),
    ("ray-dashboard-NodeHead-0 (/venv/bin/python -B -c ...)", False, True),
    ("ray::DashboardAgent", False, True),
    ("ray::RuntimeEnvAgent", False, True),
    ("ray::ServeController.listen_for_change", False, True),
    ("/venv/bin/python3 /venv/bin/serve run --address 127.0.0.1:6379 serve_config.yaml", False, True),
    # The workers the raylet starts inherit its niceness; the replicas and idle workers keep theirs.
    (f"{RAY}/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/ray/raylet", False, False),
    ("ray::ServeReplica:tokenline:EngineReplica", False, False),
    ("ray::ServeReplica:tokenline:OpenAIIngress", False, False),
    ("ray::IDLE", False, False),
    # The proxy is bookkeeping only where the ingress replica answers HTTP itself.
    ("ray::ProxyActor", False, True),
    ("ray::ProxyActor", True, False),
])
def test_what_counts_as_background(cmdline, proxy_serves, background):
    assert is_background(Proc(2, 1, cmdline), proxy_serves) is background


def test_descendants_walk_the_whole_tree_below_the_root_only():
    procs = [Proc(10, 1, "launcher"), Proc(11, 10, "gcs"), Proc(12, 10, "raylet"), Proc(13, 12, "worker"),
             Proc(14, 13, "grandchild"), Proc(20, 1, "stranger"), Proc(21, 20, "its child")]
    assert sorted(p.pid for p in descendants(procs, 10)) == [11, 12, 13, 14]


def thread_nices(pid: int) -> dict[int, int]:
    """Each thread's niceness, from /proc/PID/task/TID/stat (field 19)."""
    nices = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            nices[int(tid)] = int(f.read().rpartition(")")[2].split()[16])
    return nices


@linux_only
def test_real_processes_below_the_root_are_lowered_thread_by_thread_and_a_raylet_is_not(tmp_path):
    """A launcher-like tree: a root that starts a threaded background process and a process named `raylet` whose
    child plays a replica. Every thread of the root and the background process ends at the niceness; the raylet and
    its worker keep theirs."""
    raylet = tmp_path / "raylet"
    raylet.symlink_to(sys.executable)
    threaded = "import threading, time; [threading.Thread(target=time.sleep, args=(60,), daemon=True).start() " \
               "for _ in range(3)]; time.sleep(60)"
    # The raylet's child names itself as a replica does (Ray workers set their process title to `ray::...`).
    worker = (f"import subprocess, sys, time; subprocess.Popen(['ray::ServeReplica:app:Engine', '-c', {threaded!r}], "
              f"executable=sys.executable); time.sleep(60)")
    root_code = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {threaded!r}]); "
                 f"subprocess.Popen([{str(raylet)!r}, '-c', {worker!r}]); time.sleep(60)")
    root = subprocess.Popen([sys.executable, "-c", root_code])
    try:
        for _ in range(200):  # all four processes up, each with its threads
            tree = descendants(read_procs(), root.pid)
            if len(tree) == 3 and all(len(os.listdir(f"/proc/{p.pid}/task")) >= 4 for p in tree
                                      if "raylet" not in p.cmdline):
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"the process tree did not come up: {tree}")
        before = os.getpriority(os.PRIO_PROCESS, root.pid)
        lowered = lower_background(proxy_serves=False, nice=before + 3, root=root.pid)
        by_role = {("raylet" if p.cmdline.split(" ", 1)[0].endswith("raylet") else
                    "worker" if p.cmdline.startswith("ray::") else "background"): p.pid for p in tree}
        assert sorted(p.pid for p in lowered) == sorted([root.pid, by_role["background"]])
        for pid in (root.pid, by_role["background"]):
            assert set(thread_nices(pid).values()) == {before + 3}, pid
        for pid in (by_role["raylet"], by_role["worker"]):
            assert set(thread_nices(pid).values()) == {before}, pid
        # Again: nothing left to raise, and never lowered back.
        assert lower_background(proxy_serves=False, nice=before + 1, root=root.pid) == []
        assert set(thread_nices(root.pid).values()) == {before + 3}
    finally:
        for p in descendants(read_procs(), root.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, 9)
        root.kill()
        root.wait(10)


def test_turned_off_it_touches_nothing():
    assert lower_background(proxy_serves=False, nice=None) == []
