"""An engine's backlog in seconds: the step-cost fit, the shape of the work it owes, and a real engine's estimate."""
from __future__ import annotations

import random

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.backlog import MIN_STEPS, Backlog, Job, OutputLengths, StepCostModel
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


def test_queued_requests_take_the_first_slot_to_come_free_in_turn():
    running = [Job(10, 0, 100), Job(30, 0, 100)]
    waiting = [Job(50, 200, 300), Job(5, 100, 200), Job(5, 100, 200)]
    backlog = Backlog.of(running, waiting, max_num_seqs=2, kv_tokens=10**6)
    # Slot A frees at 10, takes the 50-step request (until 60); slot B frees at 30, takes the next two (to 40).
    assert sorted(backlog.free_at) == [40, 60] and backlog.start_step == 40 and backlog.drain_steps == 60
    assert backlog.num_requests == 5 and backlog.prefill_tokens == 400 and backlog.batch == 2
    after, finish = backlog.place([Job(8, 50, 60)])
    assert finish == 48 and after.start_step == 48
    # With room for every request, nothing waits; a KV pool holding two of these at a time makes two slots.
    assert Backlog.of(running, waiting, max_num_seqs=64, kv_tokens=10**6).start_step == 0
    assert len(Backlog.of(running, waiting, max_num_seqs=64, kv_tokens=400).free_at) == 2
    assert Backlog().start_step == 0 and Backlog().num_requests == 0


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


def test_engine_predicts_nothing_until_it_has_history_then_waits_that_grow_with_its_queue(tmp_path):
    write_tiny_model(tmp_path, "llama")
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=256, max_num_seqs=4))
    assert engine.predicted_wait_s() is None
    engine.generate([[3 + i] * (4 + 3 * i) for i in range(8)], SamplingParams(max_tokens=12, ignore_eos=True))
    assert engine.predicted_wait_s() == 0.0  # idle, with history
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    job = engine.output_lengths.job_of_new(10, params)
    finish, alone = engine.predicted_finish_s([job])
    assert 0 < alone <= finish
    waits, finishes = [], []
    for i in range(12):
        engine.add_request(f"q{i}", [7] * 10, params)
        waits.append(engine.predicted_wait_s())
        finishes.append(engine.predicted_finish_s([job])[0])
    assert waits[:3] == [0.0] * 3 and waits[3] > 0  # four slots: the fifth request waits for one
    assert all(later >= earlier for earlier, later in zip(waits, waits[1:])) and waits[-1] > 2 * waits[4]
    assert all(f > w for f, w in zip(finishes, waits))
    assert engine.predicted_wait_s([job] * 4) > waits[-1]  # requests accepted, not queued yet, count too
    while engine.has_unfinished():
        engine.step()
    assert engine.predicted_wait_s() == 0.0


def test_an_idle_engine_prices_a_request_as_alone_whatever_load_came_before(tmp_path):
    write_tiny_model(tmp_path, "llama")
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=256, max_num_seqs=4,
                                    max_num_batched_tokens=64))
    # A prefill-heavy load: long prompts, short answers, so the engine's prompt tokens per step stay high.
    engine.generate([[3 + i % 50] * 60 for i in range(40)], SamplingParams(max_tokens=2, ignore_eos=True))
    assert not engine.has_unfinished() and engine._prefill_per_step > 10
    # The step-cost fit from known steps rather than this machine's timings of a tiny model (dominated by overhead,
    # a noisy fit may price prompt tokens at 0): 1 ms a step, 0.1 ms a prompt token, 0.5 ms a decoding request.
    engine.step_costs = StepCostModel()
    for prefill, decodes in [(60, 0), (4, 4), (30, 2), (0, 4), (64, 1), (0, 1)] * 4:
        engine.step_costs.observe(prefill, decodes, 1e-3 + 1e-4 * prefill + 5e-4 * decodes)
    job = engine.output_lengths.job_of_new(8, SamplingParams(max_tokens=30, ignore_eos=True))
    finish, alone = engine.predicted_finish_s([job])
    assert finish == alone > 0
    engine.add_request("busy", [5] * 8, SamplingParams(max_tokens=30, ignore_eos=True))
    finish, alone = engine.predicted_finish_s([job])
    assert finish > alone  # with a request running, the recent load's mix prices the coming steps again
