"""A CPU engine lends a lone long prefill the CPUs its neighbours leave idle, and only then."""
from __future__ import annotations

import time

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.idle_cpus import MIN_WINDOW_S, IdleCpus
from tests.tiny_models import tiny_llama_source


def write_stat(path, cpus: dict[int, tuple[int, int]]) -> None:
    """cpuN lines with (busy user ticks, idle ticks); the aggregate line first, as the kernel writes it."""
    lines = [f"cpu  {sum(b for b, _ in cpus.values())} 0 0 {sum(i for _, i in cpus.values())} 0 0 0 0 0 0"]
    lines += [f"cpu{n} {b} 0 0 {i} 0 0 0 0 0 0" for n, (b, i) in cpus.items()]
    path.write_text("\n".join(lines) + "\nintr 1 2 3\n")


def test_idle_cpus_reads_the_idle_share_of_this_process_cpus_since_the_last_read(tmp_path):
    stat = tmp_path / "stat"
    write_stat(stat, {0: (100, 100), 1: (100, 100), 7: (0, 0)})
    probe = IdleCpus(str(stat))
    probe.cpus = {"cpu0", "cpu1"}  # cpu7 is not this process's
    probe._last = probe._read()
    time.sleep(MIN_WINDOW_S)
    write_stat(stat, {0: (200, 100), 1: (110, 190), 7: (0, 1000)})  # cpu0 busy, cpu1 90% idle
    assert probe.idle() == pytest.approx(2 * 90 / 200)
    assert probe.idle() == pytest.approx(0.9)  # again within the window: the same figure
    time.sleep(MIN_WINDOW_S)
    write_stat(stat, {0: (300, 100), 1: (210, 190)})  # both busy since
    assert probe.idle() == 0.0
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
    for idle, prompt, expected in ((1.0, long_prompt, [2, 1]), (0.3, long_prompt, [1, 1]),
                                   (1.0, short_prompt, [1, 1])):
        engine._idle_cpus = FixedIdle(idle)
        seen.clear()
        engine.generate([prompt], params)
        assert seen == expected, (idle, len(prompt))  # the prefill step borrows, the decode step never does
        assert torch.get_num_threads() == 1
    assert LLMEngine(EngineConfig(model=path, dtype="float32", block_size=4, num_kv_blocks=16, num_threads=1,
                                  prepack_weights=False), source=source)._idle_cpus is None
