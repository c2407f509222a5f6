"""bench-peers cleans up after the servers it stops, takes its ratios within each round, and runs the in-process
engine on the servers' workload beside them."""
from __future__ import annotations

import argparse
import mmap
import threading
import time

from benchmarks.bench_peers import (IN_PROCESS, Level, System, median_levels, parse_system, ratio_spread,
                                    round_order, run_engine_workload, served_shares, served_steps, shm_names,
                                    sweep_shm)
from benchmarks.step_figures import StepFigures, step_figures, trace_steps
from deployments.chrome_trace import chrome_trace
from deployments.records import ReplicaSteps
from engine.outputs import SchedulerStats
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


def test_a_file_still_held_when_its_server_stops_is_removed_once_let_go_within_the_wait(tmp_path):
    before = shm_names(tmp_path)
    (tmp_path / "psm_dying").write_bytes(b"x" * 4096)
    (tmp_path / "psm_kept").write_bytes(b"x" * 4096)
    f = open(tmp_path / "psm_dying", "r+b")
    mapped = mmap.mmap(f.fileno(), 4096)
    kept = open(tmp_path / "psm_kept", "rb")  # held past the wait: a live process's, not removed
    release = threading.Timer(1.5, lambda: (mapped.close(), f.close()))  # a killed process unmapping it
    release.start()
    try:
        started = time.monotonic()
        assert sweep_shm(before, tmp_path) == []  # no wait: both held at the first look
        assert sweep_shm(before, tmp_path, wait_s=4.0) == ["psm_dying"]
        assert 1.4 < time.monotonic() - started < 4.0 + 2.0
        assert shm_names(tmp_path) == {"psm_kept"}
    finally:
        release.join()
        kept.close()


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
        # its steps, read from the engine's own history: decode steps with every stream in them, and how busy it was
        assert lv.full_batch_steps > 0 and lv.decode_step_ms > 0 and 0 < lv.busy_share <= 1
        # its process's CPU over the level: at most its one thread's, and some of it
        assert 0 < lv.cpu_s[IN_PROCESS] <= lv.wall_s * 1.05 + 0.05


def test_a_full_batch_decode_step_is_a_decode_only_step_with_every_stream_and_busy_is_steps_over_their_span():
    steps = [(10.0, 0.05, 256, 3), (10.05, 0.010, 0, 4), (10.07, 0.012, 0, 4), (10.09, 0.030, 0, 4),
             (10.12, 0.008, 0, 3)]  # one prompt beside 3 decodes, three full decode steps, one with a stream gone
    figures = step_figures(reversed(steps), 4)
    assert figures.full_batch_steps == 3 and abs(figures.decode_step_ms - 12.0) < 1e-9
    assert abs(figures.busy_share - 0.11 / 0.128) < 1e-9
    assert step_figures([], 4) == StepFigures(0, None, None)


def test_a_servers_step_figures_come_from_its_step_trace_as_the_engines_from_its_history():
    def stats(step: int, start: float, duration: float, prefill: int, decoding: int) -> SchedulerStats:
        return SchedulerStats(step, start, duration, decoding, 0, 0.1, prefill, decoding, 1 if prefill else 0,
                              decoding, 0, 0, 0, 0)
    history = [stats(1, 1000.0, 0.04, 200, 1), stats(2, 1000.05, 0.01, 0, 2), stats(3, 1000.06, 0.014, 0, 2)]
    trace = chrome_trace([ReplicaSteps("r1", 1, "node", 1001.0, history)], [], since=999.5, until=1001.0)
    from_trace = step_figures(trace_steps(trace), 2)
    from_history = step_figures([(s.time, s.duration_s, s.num_prefill_tokens, s.num_decode_requests)
                                 for s in history], 2)
    assert from_trace.full_batch_steps == from_history.full_batch_steps == 2
    assert abs(from_trace.decode_step_ms - from_history.decode_step_ms) < 1e-6
    assert abs(from_trace.busy_share - from_history.busy_share) < 1e-6


def test_the_served_engine_step_is_set_against_the_in_process_engine_of_its_own_round():
    def lv(system: str, r: int, step_ms: float | None, busy: float | None) -> Level:
        return Level(system, 32, 128, 128, 500.0, 100.0, 200.0, 30.0, 25.0, 90.0, 10.0, round=r,
                     decode_step_ms=step_ms, busy_share=busy)
    levels = [lv("vllm", 0, None, None), lv("tokenline", 0, 24.0, 0.97), lv("engine", 0, 20.0, 0.99),
              lv("engine", 1, 16.0, 0.98), lv("tokenline", 1, 20.0, 0.95), lv("vllm", 1, None, None)]
    systems = [parse_system(s) for s in ("vllm", "tokenline=serve_config.yaml", "engine")]
    steps = served_steps(levels, systems)
    assert list(steps) == ["tokenline"]  # vLLM keeps no step trace
    cell = steps["tokenline"][32]
    assert cell["decode_step"]["rounds"] == [1.2, 1.25]
    assert (cell["served_step_ms"], cell["engine_step_ms"]) == (22.0, 18.0)
    assert (cell["served_busy"], cell["engine_busy"]) == (0.96, 0.985)
    assert served_steps(levels, systems[:2]) == {}


def test_each_round_turns_the_order_so_every_system_runs_in_every_place():
    systems = [parse_system(s) for s in ("vllm", "tokenline=serve_config.yaml", "engine")]
    orders = [round_order(systems, r) for r in range(3)]
    assert orders[0] == ["vllm", "tokenline", "engine"]
    for place in range(3):
        assert sorted(order[place] for order in orders) == ["engine", "tokenline", "vllm"]
    assert [round_order(systems[:2], r) for r in range(3)] == [["vllm", "tokenline"], ["tokenline", "vllm"],
                                                               ["vllm", "tokenline"]]  # two: every other reversed
