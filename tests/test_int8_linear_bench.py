"""`python -m benchmarks.int8_linear`: bf16 and int8 weights timed alternately by rows, a table and its JSON."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.kernels import native_int8_available, native_int8_max_rows

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not native_int8_available(), reason="int8 weights need AVX512-VNNI or AVX2")
def test_int8_linear_benchmark_times_both_kernels_at_each_row_count_and_writes_json(tmp_path):
    out = tmp_path / "int8.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.int8_linear", "--rows", "1,3", "--rounds", "3",
                          "--layers", "1", "--threads", "1", "--out", str(out)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["layers"] == 1 and report["threads"] == 1 and report["int8_max_rows"] == native_int8_max_rows()
    assert [r["rows"] for r in report["results"]] == [1, 3]
    for r in report["results"]:
        assert len(r["bf16_runs_ms"]) == len(r["int8_runs_ms"]) == 3
        assert all(t > 0 for t in r["bf16_runs_ms"] + r["int8_runs_ms"])
        assert r["ratio"] == pytest.approx(r["int8_ms"] / r["bf16_ms"])
    assert "int8 / bf16" in run.stdout and f"wrote {out}" in run.stdout
