"""`make step-breakdown`'s split of a lone prefill where the decoder layers run as one native call: the projections
come from a clock around the layers run as modules, not from the profiler's self times inside the native call, and
the phases and the engine stay native."""
from __future__ import annotations

import pytest

import benchmarks.step_breakdown as step_breakdown
from tests.test_native_layers import SHAPE, engine_for, needs_native
from tests.tiny_models import write_tiny_model

# gate/up's linear runs with SiLU-and-mul in its epilogue (Linear.silu_mul): clocked as one kind.
PROJECTIONS = {"qkv_proj", "o_proj", "gate_up_proj + silu", "down_proj"}


@needs_native
def test_a_native_prefills_projections_are_clocked_on_the_modules_and_the_layers_stay_native(tmp_path, monkeypatch):
    write_tiny_model(tmp_path, "llama", seed=3, vocab_size=40000, **SHAPE)  # random_prompts draws ids up to 40,000
    engine = engine_for(tmp_path, monkeypatch, True, max_num_batched_tokens=256)
    model = engine.runner.model
    assert model.native_layers
    native_calls = []
    forward = model._native_forward
    monkeypatch.setattr(model, "_native_forward", lambda *a: native_calls.append(1) or forward(*a))
    clocked_seen = []
    split = step_breakdown.operator_split

    def spy(prof, kinds, measured_ms, clocked=None):
        clocked_seen.append(dict(clocked or {}))
        return split(prof, kinds, measured_ms, clocked)

    monkeypatch.setattr(step_breakdown, "operator_split", spy)
    steps = 3
    result = step_breakdown.prefill_breakdown(engine, 96, steps, seed=1)

    assert model.native_layers  # restored after the module pass
    assert PROJECTIONS <= set(clocked_seen[0]) and all(clocked_seen[0][k] > 0 for k in PROJECTIONS)
    assert PROJECTIONS <= set(result["ops_ms"])
    for kind in PROJECTIONS:  # the split reports the clock's reading for them, not the profiler's share
        assert result["ops_ms"][kind] == pytest.approx(clocked_seen[0][kind])
    # warm-up, the timed steps and the profiled ones ran natively; only the clocked pass ran the modules
    assert len(native_calls) == 1 + 2 * steps
    assert result["phases_ms"]["step"] > 0 and result["prefill_tokens"] == 96
