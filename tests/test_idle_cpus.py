"""A CPU engine lends a lone long prefill the CPUs its neighbours leave idle, and only then."""
from __future__ import annotations


import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.idle_cpus import IdleCpus
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


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    return tiny_llama_source(tmp_path_factory.mktemp("tiny-llama"))


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
    seen = []
    execute = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", lambda scheduled: (seen.append(torch.get_num_threads()),
                                                                     execute(scheduled))[1])
    long_prompt, short_prompt = list(range(3, 103)), list(range(3, 13))
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    # FixedIdle: the CPUs this process could have had (its own thread's included)
    for idle, prompt, expected in ((2.0, long_prompt, [2, 1]), (1.3, long_prompt, [1, 1]),
                                   (2.0, short_prompt, [1, 1])):
        engine._idle_cpus = FixedIdle(idle)
        seen.clear()
        engine.generate([prompt], params)
        assert seen == expected, (idle, len(prompt))  # the prefill step borrows, the decode step never does
        assert torch.get_num_threads() == 1
    assert LLMEngine(EngineConfig(model=path, dtype="float32", block_size=4, num_kv_blocks=16, num_threads=1,
                                  prepack_weights=False), source=source)._idle_cpus is None
