"""bench-peers cleans up after the servers it stops, takes its ratios within each round, and runs the in-process
engine on the servers' workload beside them."""
from __future__ import annotations

import argparse
import mmap

from benchmarks.bench_peers import (Level, System, median_levels, parse_system, ratio_spread, round_order,
                                    run_engine_workload, served_shares, shm_names, sweep_shm)
from tests.tiny_models import write_tiny_model


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


def test_a_system_named_engine_is_the_in_process_engine_of_its_configuration():
    assert parse_system("vllm") == System("vllm", "vllm")
    assert parse_system("engine") == System("engine", "engine", "serve_config.yaml")
    assert parse_system("tokenline=serve_config.yaml") == System("tokenline", "tokenline", "serve_config.yaml")
    m160 = parse_system("engine-m160=serve_config.yaml,engine.max_tokens_with_decodes=160,env.OMP_WAIT_POLICY=passive")
    assert (m160.kind, m160.args, m160.env) == ("engine", {"engine.max_tokens_with_decodes": "160"},
                                                {"OMP_WAIT_POLICY": "passive"})


def test_the_served_share_pairs_each_server_with_the_engine_of_its_own_round():
    levels = [level("vllm", 0, 500.0, 400.0), level("tokenline", 0, 600.0, 200.0), level("engine", 0, 750.0, 150.0),
              level("engine", 1, 500.0, 150.0), level("tokenline", 1, 475.0, 200.0), level("vllm", 1, 300.0, 400.0)]
    systems = [parse_system(s) for s in ("vllm", "tokenline=serve_config.yaml", "engine")]
    shares = served_shares(levels, systems)
    assert list(shares) == ["tokenline"]  # vLLM's ratio to our engine is no share of anything
    assert shares["tokenline"][32]["rounds"] == [0.8, 0.95]
    assert (shares["tokenline"][32]["min"], shares["tokenline"][32]["max"]) == (0.8, 0.95)
    assert served_shares(levels, systems[:2]) == {}  # no engine run: no share


def test_the_engine_runs_the_servers_workload_in_a_process_of_its_own(tmp_path):
    # A vocabulary the workload's random token ids (300-40,000) fit in; fp32 on one thread, a small KV cache.
    write_tiny_model(tmp_path / "model", "llama", vocab_size=40064)
    system = parse_system("engine=serve_config.yaml,engine.dtype=float32,engine_num_cpus=1,"
                          "engine.kv_cache_memory_bytes=8388608,engine.prefill_threads=null,"
                          "engine.decode_threads=null")
    args = argparse.Namespace(input_len=24, output_len=6, prompts_per_concurrency=3)
    levels = run_engine_workload(system, str(tmp_path / "model"), [1, 4], args, tmp_path / "engine.log",
                                 timeout_s=300)
    assert [(lv.system, lv.concurrency, lv.num_prompts, lv.completed) for lv in levels] == [
        ("engine", 1, 8, 8), ("engine", 4, 12, 12)]  # at least 8 a level, as the client sends a server
    for lv in levels:
        assert lv.output_tok_s > 0 and lv.ttft_p50_ms > 0 and lv.tpot_p50_ms > 0 and lv.itl_p99_ms >= lv.itl_p50_ms
        assert abs(lv.output_tok_s * lv.wall_s - lv.num_prompts * 6) < 1e-6 * lv.num_prompts * 6


def test_each_round_turns_the_order_so_every_system_runs_in_every_place():
    systems = [parse_system(s) for s in ("vllm", "tokenline=serve_config.yaml", "engine")]
    orders = [round_order(systems, r) for r in range(3)]
    assert orders[0] == ["vllm", "tokenline", "engine"]
    for place in range(3):
        assert sorted(order[place] for order in orders) == ["engine", "tokenline", "vllm"]
    assert [round_order(systems[:2], r) for r in range(3)] == [["vllm", "tokenline"], ["tokenline", "vllm"],
                                                               ["vllm", "tokenline"]]  # two: every other reversed
