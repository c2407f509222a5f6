"""bench-peers' CPU by process: each process's CPU time between two reads of /proc, sorted by the role it plays
in a served level, and the client's from the benchmark's own children."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.bench_peers import Level, cpu_per_token
from benchmarks.process_cpu import (CLIENT, OTHER, LevelCPU, ProcessTime, cpu_by_role, per_token_ms, read_stat,
                                    role, snapshot)

TICK = os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("comm, cmdline, expected", [
    ("ray::ServeRepli", "ray::ServeReplica:tokenline:EngineReplica.handle_request_with_rejection", "engine replica"),
    ("ray::ServeRepli", "ray::ServeReplica:tokenline:OpenAIIngress", "ingress"),
    ("ray::ProxyActor", "ray::ProxyActor", "Serve proxy"),
    ("ray::ServeContr", "ray::ServeController", "Serve controller"),
    ("gcs_server", "/v/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp", "Ray GCS"),
    ("raylet", "/v/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x", "raylet"),
    ("ray::DashboardA", "ray::DashboardAgent", "Ray dashboard"),
    ("python", "/v/bin/python -u /v/lib/python3.11/site-packages/ray/_private/log_monitor.py", "Ray other"),
    ("ray::IDLE", "ray::IDLE", "Ray other"),
    ("serve", "/v/bin/python3 /v/bin/serve run --address 127.0.0.1:6379 /tmp/x.yaml", "serve run"),
    ("VLLM::EngineCor", "VLLM::EngineCore", "vLLM engine core"),
    ("VLLM::Worker", "VLLM::Worker", "vLLM worker"),
    ("vllm", "/p/bin/python3 /p/bin/vllm serve /models/hf --port 8100", "vLLM API server"),
    ("sshd", "sshd: root@pts/0", OTHER),
])
def test_each_process_of_a_served_level_has_its_role(comm, cmdline, expected):
    assert role(comm, cmdline) == expected


def test_a_stat_line_gives_the_name_and_user_plus_system_time():
    # a name with spaces and parentheses, as a thread may set it; utime 150 ticks, stime 50
    stat = "1234 (ray::a (b) c) S 1 1234 1234 0 -1 4194560 10 0 0 0 150 50 0 0 20 0 3 0 100 0 0"
    assert read_stat(stat) == ("ray::a (b) c", pytest.approx(200 / TICK))


def test_cpu_by_role_counts_what_each_process_spent_between_the_reads():
    before = {1: ProcessTime("ray::ServeRepli", "ray::ServeReplica:app:EngineReplica", 10.0),
              2: ProcessTime("ray::ServeRepli", "ray::ServeReplica:app:OpenAIIngress", 1.0),
              3: ProcessTime("raylet", "ray/core/src/ray/raylet/raylet", 2.0),
              4: ProcessTime("gone", "a process that exits", 5.0)}
    after = {1: ProcessTime("ray::ServeRepli", "ray::ServeReplica:app:EngineReplica", 28.0),
             2: ProcessTime("ray::ServeRepli", "ray::ServeReplica:app:OpenAIIngress", 2.5),
             3: ProcessTime("raylet", "ray/core/src/ray/raylet/raylet", 2.0),  # idle: not listed
             5: ProcessTime("ray::IDLE", "ray::IDLE", 0.25)}  # started in between: from zero
    assert cpu_by_role(before, after) == {"engine replica": 18.0, "ingress": 1.5, "Ray other": 0.25}
    assert per_token_ms({"engine replica": 18.0, "ingress": 1.5}, 1000) == {"engine replica": 18.0, "ingress": 1.5}


def test_a_level_counts_a_running_process_and_the_client_that_exited():
    # A process that runs through the level (as a server's) and a child that runs and exits within it (as the
    # client does): each one's CPU lands under its role, this process's own not at all.
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"
    server = subprocess.Popen([sys.executable, "-c", "import time\ntime.sleep(0.3)\n" + burn.format(s=0.4)
                               + "time.sleep(30)", "EngineReplica"])
    try:
        cpu = LevelCPU()
        cpu.start()
        subprocess.run([sys.executable, "-c", burn.format(s=0.3)], check=True)  # the client
        t = time.process_time()
        while time.process_time() - t < 0.2:  # the benchmark's own work: not counted
            pass
        time.sleep(1.0)  # the server has burnt its 0.4 s by now
        spent = cpu.stop()
    finally:
        server.kill()
        server.wait()
    assert spent["engine replica"] == pytest.approx(0.4, abs=0.15)
    assert spent[CLIENT] >= 0.3 and spent[CLIENT] < 1.5  # its burn and its interpreter's start
    # Not the whole machine's other processes against a bound: a run's Ray processes (and anything else on the
    # machine) spend what they spend. This process is left out of both reads by its pid.
    assert os.getpid() in snapshot() and os.getpid() not in snapshot(exclude=frozenset({os.getpid()}))


def test_without_a_proc_to_read_a_level_reports_only_the_client(tmp_path):
    cpu = LevelCPU(tmp_path / "no-proc")
    cpu.start()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    spent = cpu.stop()
    assert set(spent) == {CLIENT} and spent[CLIENT] > 0


def test_cpu_per_token_is_the_median_over_rounds_of_each_roles_ms_per_output_token():
    def lv(r: int, engine_s: float, ingress_s: float) -> Level:
        return Level("tokenline", 32, 128, 128, 1000.0, 100.0, 200.0, 30.0, 25.0, 90.0, 10.0, round=r,
                     cpu_s={"engine replica": engine_s, "ingress": ingress_s})
    levels = [lv(0, 18.0, 1.0), lv(1, 20.0, 1.2), lv(2, 22.0, 0.8), Level("vllm", 32, 128, 128, 500.0, 1, 2, 3, 4, 5,
                                                                           10.0)]
    cell = cpu_per_token(levels)["tokenline"][32]  # 10,000 tokens a level
    # the total is the median of the rounds' totals (1.9, 2.12, 2.28 ms), each role's its own median
    assert cell == {"engine replica": pytest.approx(2.0), "ingress": pytest.approx(0.1),
                    "total": pytest.approx(2.12)}
    assert [k for k in cell if k != "total"] == ["engine replica", "ingress"]  # the largest first
    assert "vllm" not in cpu_per_token(levels)  # no CPU read: nothing to show
