"""bench-peers cleans up after the servers it stops, and takes its ratios within each round."""
from __future__ import annotations

import mmap

from benchmarks.bench_peers import Level, median_levels, ratio_spread, shm_names, sweep_shm


def test_shared_memory_a_stopped_server_left_behind_is_removed_and_nothing_else(tmp_path):
    (tmp_path / "psm_before").write_bytes(b"x")
    before = shm_names(tmp_path)
    for name in ("psm_leaked", "sem.mp-leaked", "__KMP_REGISTERED_LIB_123_0", "psm_mapped", "tokenline-weights-1.bin"):
        (tmp_path / name).write_bytes(b"x" * 4096)
    with open(tmp_path / "psm_mapped", "r+b") as f, mmap.mmap(f.fileno(), 4096):
        # held by this process (open and mapped): still in use, kept; another program's file: not ours to remove
        assert sweep_shm(before, tmp_path) == ["__KMP_REGISTERED_LIB_123_0", "psm_leaked", "sem.mp-leaked"]
    assert shm_names(tmp_path) == {"psm_before", "psm_mapped", "tokenline-weights-1.bin"}
    assert sweep_shm(shm_names(tmp_path), tmp_path) == []


def level(system: str, round_: int, tok_s: float, ttft_ms: float, concurrency: int = 32) -> Level:
    return Level(system, concurrency, 128, 128, tok_s, ttft_ms, 2 * ttft_ms, 40.0, 30.0, 90.0, 20.0, round=round_)


def test_ratios_over_rounds_pair_the_systems_within_each_round_not_across_them():
    # The machine slows down between rounds: each round's ratio is 1.2x, whatever the hour did to both.
    levels = [level("tokenline", 0, 600.0, 200.0), level("vllm", 0, 500.0, 400.0),
              level("vllm", 1, 250.0, 800.0), level("tokenline", 1, 300.0, 400.0),
              level("tokenline", 2, 720.0, 300.0), level("vllm", 2, 400.0, 300.0)]
    spread = ratio_spread(levels, "vllm")
    tok = spread["tokenline"][32]["output_tok_s"]
    assert tok["rounds"] == [1.2, 1.2, 1.8]
    assert (tok["median"], tok["min"], tok["max"]) == (1.2, 1.2, 1.8)
    ttft = spread["tokenline"][32]["ttft_p50"]
    assert (ttft["median"], ttft["min"], ttft["max"]) == (0.5, 0.5, 1.0)
    assert "vllm" not in spread
    # The medians of each system's own figures: 600 / 300 / 720 -> 600, 500 / 250 / 400 -> 400 (600 / 400 = 1.5x,
    # not the 1.2x the rounds gave: why the ratios are taken within rounds).
    medians = {lv.system: lv for lv in median_levels(levels)}
    assert medians["tokenline"].output_tok_s == 600.0 and medians["vllm"].output_tok_s == 400.0
    assert medians["tokenline"].ttft_p50_ms == 300.0 and medians["tokenline"].round == -1


def test_one_round_gives_the_plain_ratios():
    levels = [level("vllm", 0, 400.0, 500.0, c) for c in (1, 32)] + [level("tokenline", 0, 520.0, 250.0, c)
                                                                     for c in (1, 32)]
    spread = ratio_spread(levels, "vllm")
    assert sorted(spread["tokenline"]) == [1, 32]
    assert spread["tokenline"][1]["output_tok_s"] == {"rounds": [1.3], "median": 1.3, "min": 1.3, "max": 1.3}
