"""An engine's backlog in seconds: the step-cost fit, the shape of the work it owes, and a real engine's estimate."""
from __future__ import annotations

import random

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.backlog import MIN_STEPS, OutputLengths, StepCostModel, Work
from tests.tiny_models import write_tiny_model


def test_step_cost_fit_separates_overhead_prompt_tokens_and_decodes():
    model = StepCostModel()
    rng = random.Random(0)
    for _ in range(400):
        prefill, decodes = rng.choice([0, 0, 16, 300, 2000]), rng.randrange(1, 64)
        model.observe(prefill, decodes, 0.020 + 0.0005 * prefill + 0.004 * decodes + rng.uniform(-0.001, 0.001))
    overhead, per_prefill, per_decode = model.coefficients()
    assert overhead == pytest.approx(0.020, rel=0.1)
    assert per_prefill == pytest.approx(0.0005, rel=0.05) and per_decode == pytest.approx(0.004, rel=0.05)


def test_a_term_the_steps_cannot_separate_drops_out_and_nothing_is_negative():
    model = StepCostModel()
    for _ in range(MIN_STEPS - 1):
        model.observe(0, 32, 0.064)  # always the same batch: overhead and per-decode cost are one number
    assert not model.ready
    model.observe(0, 32, 0.064)
    overhead, per_prefill, per_decode = model.coefficients()
    assert model.ready and min(overhead, per_prefill, per_decode) >= 0
    assert overhead + 32 * per_decode == pytest.approx(0.064)  # what the steps show is still predicted


def test_draining_decodes_pays_one_overhead_per_step_of_the_batch_the_engine_holds():
    model = StepCostModel()
    for prefill, decodes in [(0, 1), (0, 10), (100, 10), (0, 100)] * 20:
        model.observe(prefill, decodes, 0.010 + 0.0002 * prefill + 0.001 * decodes)
    # 40 requests with 50 tokens left each: 4 at once (max_num_seqs) is 500 steps; 40 at once would be 50.
    work = sum((Work(0, 50, 50, 1, 100) for _ in range(40)), Work())
    assert model.seconds(work, 4, 2048, 10**6) == pytest.approx(500 * 0.010 + 2000 * 0.001, rel=0.02)
    assert model.seconds(work, 64, 2048, 10**6) == pytest.approx(50 * 0.010 + 2000 * 0.001, rel=0.02)
    # ... unless the KV pool holds fewer: 1,000 tokens of KV fit 10 of these requests.
    assert model.seconds(work, 64, 2048, 1000) == pytest.approx(200 * 0.010 + 2000 * 0.001, rel=0.02)
    # Prompt tokens cost their own rate.
    assert model.seconds(Work(1000, 1, 1, 1, 1001), 64, 2048, 10**6) == pytest.approx(
        1 * 0.010 + 1000 * 0.0002 + 0.001, rel=0.02)
    assert model.seconds(Work(), 64, 2048, 1000) == 0.0


def test_expected_output_follows_real_lengths_but_never_max_tokens_or_min_tokens():
    lengths = OutputLengths()
    capped = SamplingParams(max_tokens=1000)
    assert lengths.expected(capped) == 1000  # nothing seen yet: the bound
    for n in [40, 60] * 50:
        lengths.observe(n)
    assert 40 < lengths.expected(capped) < 60
    assert lengths.expected(SamplingParams(max_tokens=20)) == 20
    assert lengths.expected(SamplingParams(max_tokens=1000, min_tokens=300)) == 300
    assert lengths.expected(SamplingParams(max_tokens=1000, ignore_eos=True)) == 1000


def test_engine_predicts_nothing_until_it_has_history_then_a_wait_that_grows_with_its_queue(tmp_path):
    write_tiny_model(tmp_path, "llama")
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=256, max_num_seqs=4))
    assert engine.predicted_wait_s() is None
    engine.generate([[3 + i] * (4 + 3 * i) for i in range(8)], SamplingParams(max_tokens=12, ignore_eos=True))
    assert engine.predicted_wait_s() == 0.0  # idle, with history
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    waits = []
    for i in range(12):
        engine.add_request(f"q{i}", [7] * 10, params)
        waits.append(engine.predicted_wait_s())
    assert all(later >= earlier for earlier, later in zip(waits, waits[1:])) and waits[-1] > 2 * waits[3], waits
    extra = engine.predicted_wait_s(Work(1000, num_requests=1, context_tokens=1000))
    assert extra > waits[-1]
    while engine.has_unfinished():
        engine.step()
    assert engine.predicted_wait_s() == 0.0
