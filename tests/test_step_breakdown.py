"""`make step-breakdown`'s split of a lone prefill where the decoder layers run as one native call: the projections
come from a clock around the layers run as modules, not from the profiler's self times inside the native call, and
the phases and the engine stay native."""
from __future__ import annotations

import pytest

import benchmarks.step_breakdown as step_breakdown
from engine import EngineConfig, LLMEngine
from engine.kernels import native_layers_available
from engine.models.llama import NATIVE_LAYERS_ENV
from tests.tiny_models import write_tiny_model

PROJECTIONS = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


@pytest.mark.skipif(not native_layers_available(), reason="this CPU has no AVX512-BF16 (or no C++ toolchain): the "
                                                          "native layers are not built")
def test_a_native_prefills_projections_are_clocked_on_the_modules_and_the_layers_stay_native(tmp_path, monkeypatch):
    # random_prompts draws ids up to 40,000; head_dim 64, the native layers' packed keys
    write_tiny_model(tmp_path, "llama", seed=3, vocab_size=40000, hidden_size=256, intermediate_size=512,
                     num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.setenv(NATIVE_LAYERS_ENV, "1")
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="bfloat16", num_kv_blocks=64, block_size=16,
                                    max_num_batched_tokens=256, native_linear_max_rows=2048))
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
