"""The benchmarks' shared picture: grouped bars from their JSON rows, one panel per metric."""
from __future__ import annotations

import struct
from dataclasses import asdict

from benchmarks.bench_router import Row
from benchmarks.plot import plot_bars


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_rows_become_a_png_with_one_panel_per_metric_and_gaps_for_missing_values(tmp_path):
    rows = [asdict(Row(workload, policy, 128, 0, hit, hit, 480.0, 6000.0, 80.0, 300.0, 44.7))
            for workload in ("shared-prefix", "mooncake") for policy, hit in (("prefix_aware", 71.3),
                                                                           ("power_of_two", float("nan")))]
    rows.append({"workload": "mooncake", "policy": "other", "output_tok_s": 20.0})  # the other metrics missing
    one = plot_bars(rows, "workload", "policy", {"output_tok_s": "output tokens/s"}, tmp_path / "one.png")
    three = plot_bars(rows, "workload", "policy", {"hit_rate_pct": "hit %", "ttft_p50_ms": "TTFT p50 (ms)",
                                                   "output_tok_s": "output tokens/s"}, tmp_path / "a" / "three.png",
                      title="routers")
    (w1, h1), (w3, h3) = png_size(one.read_bytes()), png_size(three.read_bytes())
    assert h1 == h3 and w3 > 2 * w1 and three.stat().st_size > 10_000
