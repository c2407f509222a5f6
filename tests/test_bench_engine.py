"""bench-engine's in-process run of bench-peers' workload: a closed loop of requests at a concurrency limit."""
from __future__ import annotations

from pathlib import Path

from benchmarks.bench_engine import random_prompts, run_served_workload, served_engine_config
from engine import EngineConfig, LLMEngine
from tests.tiny_models import write_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def test_the_workload_keeps_at_most_its_concurrency_in_flight_and_replaces_each_finished_request(tmp_path):
    write_tiny_model(tmp_path / "model", "llama")
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "model"), max_num_seqs=8, max_num_batched_tokens=64,
                                    num_threads=1))
    prompts = [p[:20] for p in random_prompts(7, 20, seed=3)]
    prompts = [[t % 500 + 3 for t in p] for p in prompts]  # the tiny vocabulary, past its special tokens
    run = run_served_workload(engine, prompts, concurrency=3, output_len=5)
    assert (run.concurrency, run.requests, run.output_tokens) == (3, 7, 35)
    steps = [s for s in engine.step_history if s.step > engine.stats().num_steps - run.steps]
    assert len(steps) == run.steps
    assert max(s.num_running for s in steps) == 3  # never more than the limit, and the limit reached
    # Seven requests of five tokens three at a time: the closed loop refills, so no step runs fewer than three
    # until the last requests drain.
    assert sum(1 for s in steps if s.num_running < 3) < run.steps / 2
    assert run.output_tok_s > 0 and run.ttft_p50_ms > 0 and run.itl_p99_ms > 0


def test_the_served_engine_is_the_one_make_serve_builds_on_the_given_model():
    config = served_engine_config(ROOT / "serve_config.yaml", "/models/elsewhere.gguf", 32)
    assert config.model == "/models/elsewhere.gguf"
    assert config.max_num_batched_tokens == 320 and config.max_tokens_with_decodes is None
    assert config.num_threads == 2 and config.max_num_seqs >= 32
    assert served_engine_config(ROOT / "serve_config.yaml", "m", 100).max_num_seqs == 100
