"""The torch profiler runs on the engine's step thread, so a trace holds the forward passes of real requests."""
from __future__ import annotations

import asyncio
import json

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.profiler import StepProfiler, write_chrome_trace
from tests.tiny_models import write_tiny_model


def test_profile_started_on_the_step_thread_records_the_steps_of_a_request(tmp_path):
    write_tiny_model(tmp_path / "model", "llama")
    engine = AsyncEngine(EngineConfig(model=str(tmp_path / "model"), dtype="float32", num_kv_blocks=64))
    profiler = StepProfiler()

    async def main():
        assert await engine.run_on_step_thread(profiler.start)
        assert not await engine.run_on_step_thread(profiler.start)  # already running
        async for _ in engine.generate([5] * 20, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)):
            pass
        finished = await engine.run_on_step_thread(profiler.stop)
        assert await engine.run_on_step_thread(profiler.stop) is None  # nothing left to stop
        return finished

    try:
        finished = asyncio.run(main())
    finally:
        engine.shutdown()
    path = write_chrome_trace(finished, tmp_path / "traces" / "replica.pt.trace.json")
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    # fp32 linears: oneDNN's prepacked kernel where torch has it, else F.linear
    assert {"mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::linear"} & names, sorted(names)[:40]
    assert engine.error is None


def test_an_error_on_the_step_thread_reaches_the_caller_and_the_loop_goes_on(tmp_path):
    write_tiny_model(tmp_path / "model", "llama")
    engine = AsyncEngine(EngineConfig(model=str(tmp_path / "model"), dtype="float32", num_kv_blocks=64))

    def fail():
        raise ValueError("refused")

    async def main():
        try:
            await engine.run_on_step_thread(fail)
        except ValueError as exc:
            assert str(exc) == "refused"
        else:
            raise AssertionError("the error was swallowed")
        outputs = [o async for o in engine.generate([5] * 8, SamplingParams(max_tokens=2, ignore_eos=True))]
        return outputs, engine.is_healthy

    try:
        outputs, healthy = asyncio.run(main())
    finally:
        engine.shutdown()
    assert outputs[-1].finished and healthy
