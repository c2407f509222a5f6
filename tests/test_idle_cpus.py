"""A CPU engine lends a lone long prefill the CPUs its neighbours leave idle, and only then."""
from __future__ import annotations


import os
import subprocess
import sys

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.idle_cpus import CLOCK_TICKS, EngineBoard, IdleCpus
from tests.tiny_models import tiny_llama_source


def write_stat(path, cpus: dict[int, tuple[int, int]]) -> None:
    """cpuN lines with (busy user ticks, idle ticks); the aggregate line first, as the kernel writes it."""
    lines = [f"cpu  {sum(b for b, _ in cpus.values())} 0 0 {sum(i for _, i in cpus.values())} 0 0 0 0 0 0"]
    lines += [f"cpu{n} {b} 0 0 {i} 0 0 0 0 0 0" for n, (b, i) in cpus.items()]
    path.write_text("\n".join(lines) + "\nintr 1 2 3\n")


def test_idle_cpus_reads_what_others_left_of_this_process_cpus_since_the_last_read(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    own = [0.0]  # this process's CPU seconds
    monkeypatch.setattr("engine.idle_cpus.time.process_time", lambda: own[0])
    write_stat(stat, {0: (100, 100), 1: (100, 100), 7: (0, 0)})
    probe = IdleCpus(str(stat))
    probe.cpus = {"cpu0", "cpu1"}  # cpu7 is not this process's
    probe._last = probe._read()
    probe._last_at -= 1.0  # a one-second window
    write_stat(stat, {0: (200, 100), 1: (110, 190), 7: (0, 1000)})  # cpu0 busy, cpu1 90% idle
    own[0] = 0.5  # half of cpu0's busy time was this process's own
    assert probe.idle() == pytest.approx(2 * 90 / 200 + 0.5, abs=0.01)
    assert probe.idle() == pytest.approx(1.4, abs=0.01)  # again within the window: the same figure
    probe._last_at -= 1.0
    write_stat(stat, {0: (300, 100), 1: (210, 190)})  # both busy since, by others
    assert probe.idle() == 0.0
    probe._last_at -= 1.0
    write_stat(stat, {0: (400, 100), 1: (310, 190)})  # both busy, all of it this process (it borrowed)
    own[0] = 2.5
    assert probe.idle() == pytest.approx(2.0, abs=0.01)
    assert IdleCpus(str(tmp_path / "missing")).idle() == 0.0


def write_proc_stat(proc, pid: int, cpu_s: float) -> None:
    """/proc/PID/stat with utime = cpu_s (a name with a space and a parenthesis, as the kernel may write one)."""
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    ticks = int(cpu_s * CLOCK_TICKS)
    (proc / str(pid) / "stat").write_text(f"{pid} (ray::Engine (x)) S 1 1 1 0 -1 0 0 0 0 0 {ticks} 0 0 0 20 0\n")


def exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_engine_board_tells_each_engine_what_its_live_neighbours_run_on_now(tmp_path):
    neighbour_pid = os.getppid()  # alive for as long as the test runs
    mine, neighbour = EngineBoard(tmp_path), EngineBoard(tmp_path, pid=neighbour_pid)
    mine.publish(1)
    assert mine.others() == {}
    neighbour.publish(2)
    assert mine.others() == {neighbour_pid: 2} and neighbour.others() == {os.getpid(): 1}
    neighbour.publish(0)
    assert mine.others() == {neighbour_pid: 0}
    gone = EngineBoard(tmp_path, pid=exited_pid())
    gone.publish(1)
    assert mine.others() == {neighbour_pid: 0}  # an engine whose process has ended is not counted, and its file goes
    assert not (tmp_path / str(gone.pid)).exists()
    neighbour.close()
    assert mine.others() == {} and sorted(os.listdir(tmp_path)) == [str(os.getpid())]
    blocked = tmp_path / "file"
    blocked.write_text("")
    lone = EngineBoard(blocked / "board")  # a board that cannot be made: nobody is seen, publishing does nothing
    lone.publish(1)
    assert lone.others() == {}


def test_a_neighbour_that_went_idle_counts_as_idle_although_it_kept_a_cpu_busy_over_the_window(tmp_path,
                                                                                                monkeypatch):
    stat, proc, board_dir = tmp_path / "stat", tmp_path / "proc", tmp_path / "board"
    own = [0.0]
    monkeypatch.setattr("engine.idle_cpus.time.process_time", lambda: own[0])
    neighbour_pid = os.getppid()
    mine, neighbour = EngineBoard(board_dir), EngineBoard(board_dir, pid=neighbour_pid)
    neighbour.publish(1)
    write_stat(stat, {0: (100, 100), 1: (100, 100)})
    write_proc_stat(proc, neighbour_pid, 10.0)
    probe = IdleCpus(str(stat), board=mine, proc=str(proc))
    probe.cpus = {"cpu0", "cpu1"}
    probe._last_at -= 1.0  # a one-second window: the neighbour ran one CPU (100 ticks), the serving 0.1 of the other
    write_stat(stat, {0: (200, 100), 1: (110, 190)})
    write_proc_stat(proc, neighbour_pid, 11.0)
    assert probe.idle() == pytest.approx(0.9, abs=0.02)  # still running: what the window says
    neighbour.publish(0)  # it has just finished its last request
    assert probe.idle() == pytest.approx(1.9, abs=0.02)
    neighbour.publish(2)  # it borrowed both CPUs meanwhile
    assert probe.idle() == 0.0
    mine.close()
    neighbour.close()


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    return tiny_llama_source(tmp_path_factory.mktemp("tiny-llama"))


def threads_seen(engine: LLMEngine, monkeypatch) -> list[int]:
    """The torch threads each of the engine's steps runs its model on, from now on."""
    seen: list[int] = []
    execute = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", lambda scheduled: (seen.append(torch.get_num_threads()),
                                                                     execute(scheduled))[1])
    return seen


class FixedIdle:
    def __init__(self, idle: float) -> None:
        self.value, self.calls = idle, 0

    def idle(self) -> float:
        self.calls += 1
        return self.value


def test_long_prefill_runs_on_prefill_threads_only_while_the_other_cpus_are_idle(tiny_source, monkeypatch):
    path, source = tiny_source
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", block_size=4, num_kv_blocks=128, num_threads=1,
                                    prefill_threads=2, prepack_weights=False), source=source)
    seen = threads_seen(engine, monkeypatch)
    def long_prompt(first: int) -> list[int]:  # a new one each time: a cached prefix would leave little to prefill
        return list(range(first, first + 100))

    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    # FixedIdle: the CPUs this process could have had (its own thread's included)
    for idle, prompt, expected in ((2.0, long_prompt(3), [2, 1]), (1.45, long_prompt(200), [1, 1]),
                                   (1.55, long_prompt(400), [2, 1]), (2.0, list(range(3, 13)), [1, 1])):
        engine._idle_cpus = FixedIdle(idle)
        seen.clear()
        engine.generate([prompt], params)
        assert seen == expected, (idle, len(prompt))  # the prefill step borrows, the decode step never does
        assert [s.num_threads for s in list(engine.step_history)[-2:]] == expected  # the step trace says so
        assert torch.get_num_threads() == 1
    assert LLMEngine(EngineConfig(model=path, dtype="float32", block_size=4, num_kv_blocks=16, num_threads=1,
                                  prepack_weights=False), source=source)._idle_cpus is None


def test_decode_steps_run_on_decode_threads_only_while_the_other_cpus_are_idle_with_the_same_tokens(tiny_source,
                                                                                                   monkeypatch):
    path, source = tiny_source
    def engine_with(**threads) -> tuple[LLMEngine, list[int]]:
        engine = LLMEngine(EngineConfig(model=path, dtype="float32", block_size=4, num_kv_blocks=128, num_threads=1,
                                        prepack_weights=False, enable_prefix_caching=False, **threads), source=source)
        return engine, threads_seen(engine, monkeypatch)

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 103)), list(range(7, 19))]
    alone, _ = engine_with()
    expected = alone.generate(prompts, params)
    engine, seen = engine_with(decode_threads=2)
    # The long prompt's prefill and the short one's share the first step: a prefill step, not borrowed
    # without prefill_threads.
    for idle, threads in ((2.0, [1, 2, 2, 2]), (1.45, [1, 1, 1, 1]), (1.55, [1, 2, 2, 2])):
        engine._idle_cpus = FixedIdle(idle)
        seen.clear()
        assert engine.generate(prompts, params) == expected
        assert seen == threads, idle
        assert torch.get_num_threads() == 1
    both, seen = engine_with(decode_threads=2, prefill_threads=2)
    both._idle_cpus = FixedIdle(2.0)
    assert both.generate(prompts, params) == expected and seen == [2, 2, 2, 2]
