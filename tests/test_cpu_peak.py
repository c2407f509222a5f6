"""`python -m benchmarks.cpu_peak`: the FMA loop builds, runs on each thread count asked for and writes its JSON;
a decode token's FLOPs come from the model's own shape."""
from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.cpu_peak import decode_flops

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")) or platform.machine() != "x86_64",
                    reason="the FMA loop is x86-64 (AVX2 or AVX-512) and needs a C compiler")
def test_the_peak_is_measured_on_each_thread_count_and_bounds_a_models_decode(tmp_path, smollm2_path):
    out = tmp_path / "peak.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.cpu_peak", "--threads", "1", "--iterations", "200000",
                          "--repeats", "2", "--model", str(smollm2_path), "--batch", "4", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["threads"]) == {"1"} and result["threads"]["1"] > 0.5
    assert set(result["int16_gmacs"]) == {"1"} and result["int16_gmacs"]["1"] > 0.25
    assert result["vector_lanes"] in (8, 16)
    model = result["model"]
    assert model["max_decode_tok_s"] == pytest.approx(4 / model["min_step_ms"] * 1000)
    assert model["min_step_ms"] == pytest.approx(model["decode_mflop_per_token"] * 1e6 * 4
                                                 / (result["threads"]["1"] * 1e9) * 1000)


def test_a_decode_tokens_flops_are_every_weight_twice_and_attention_over_its_context(smollm2_path):
    flops, _ = decode_flops(str(smollm2_path), context=300)
    # SmolLM2-135M: 30 layers, hidden 576, 9 query and 3 KV heads of 64, MLP 1,536, vocabulary 49,152.
    layer = 576 * (9 + 2 * 3) * 64 + 9 * 64 * 576 + 3 * 576 * 1536
    assert flops == 2 * (30 * layer + 576 * 49152 + 30 * 9 * 64 * 300 * 2)
