"""The batched sampler on hand-made logits: each filter keeps exactly the tokens it should."""
from __future__ import annotations

import math

import pytest
import torch

from engine.request import Request
from engine.sampler import Sampler, SamplingBatch
from engine.sampling_params import SamplingParams

PROBS = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])


@pytest.fixture(autouse=True, params=["native", "torch"])
def sampler_path(request, monkeypatch):
    """Every test runs on both paths: the native kernel (engine/kernels/sampling_cpu.cpp) and torch's ops."""
    import engine.kernels

    if request.param == "native":
        if not engine.kernels.native_sampler_available():
            pytest.skip("the native CPU kernels are not available here")
    else:
        monkeypatch.setattr(engine.kernels, "native_sampler_available", lambda: False)
    return request.param


def draw(params: SamplingParams, n: int = 4000, output_tokens: int = 0) -> torch.Tensor:
    requests = []
    for i in range(n):
        r = Request(f"r{i}", [1], params, 16, eos_token_ids=(0,))
        r.output_token_ids = [3] * output_tokens
        requests.append(r)
    logits = PROBS.log().repeat(n, 1)
    tokens, _ = Sampler()(logits, SamplingBatch.from_requests(requests, 5, torch.device("cpu")))
    return torch.bincount(torch.tensor(tokens), minlength=5).float() / n


def test_greedy_takes_the_argmax():
    assert draw(SamplingParams(temperature=0), n=10).tolist() == [1, 0, 0, 0, 0]


def test_plain_sampling_follows_the_distribution():
    freq = draw(SamplingParams(temperature=1.0))
    assert torch.allclose(freq, PROBS, atol=0.03)


def test_top_k_keeps_the_k_most_likely():
    freq = draw(SamplingParams(temperature=1.0, top_k=2))
    assert freq[2:].sum() == 0
    assert math.isclose(freq[0], 0.5 / 0.7, abs_tol=0.03)


def test_top_p_keeps_the_smallest_set_reaching_p():
    freq = draw(SamplingParams(temperature=1.0, top_p=0.8))  # 0.5 + 0.2 < 0.8, so 0.15 is kept too
    assert freq[3:].sum() == 0 and freq[2] > 0


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    freq = draw(SamplingParams(temperature=1.0, min_p=0.3))  # keeps p >= 0.15
    assert freq[3:].sum() == 0 and freq[2] > 0


def test_low_temperature_sharpens():
    assert draw(SamplingParams(temperature=0.1))[0] > 0.99


def test_min_tokens_bans_eos_until_reached():
    assert draw(SamplingParams(temperature=0, min_tokens=2), n=10, output_tokens=1)[0] == 0
    assert draw(SamplingParams(temperature=0, min_tokens=2), n=10, output_tokens=2)[0] == 1


def test_seeded_rows_do_not_depend_on_their_neighbours():
    def sample(batch_size):
        reqs = [Request(f"r{i}", [1], SamplingParams(temperature=1.0, seed=7 if i == 0 else None), 16)
                for i in range(batch_size)]
        # The same row for every batch size (randn of a larger shape would not start with the same row).
        logits = torch.randn(1000, generator=torch.Generator().manual_seed(0)).expand(batch_size, 1000).clone()
        tokens = []
        sampler = Sampler()
        for _ in range(5):
            tokens.append(sampler(logits.clone(), SamplingBatch.from_requests(reqs, 1000, torch.device("cpu")))[0][0])
        return tokens
    assert sample(1) == sample(9)


def reference_logits(logits, prompt, output, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """Written from the definitions, one token at a time: OpenAI's logit_bias (clamped to [-100, 100]),
    vLLM's repetition penalty over prompt and output, OpenAI's frequency and presence penalties over the output."""
    out = logits.clone()
    for token, value in (bias or {}).items():
        out[token] += max(-100.0, min(100.0, value))
    for token in range(out.shape[0]):
        if repetition != 1.0 and (token in prompt or token in output):
            out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
        count = output.count(token)
        out[token] -= frequency * count + presence * (count > 0)
    return out


def test_penalties_and_logit_bias_change_the_logits_as_defined():
    vocab = 64
    gen = torch.Generator().manual_seed(0)
    cases = [  # (params, prompt, output); the plain row must come back untouched
        (SamplingParams(presence_penalty=0.7), [1, 2], [3, 3, 9]),
        (SamplingParams(frequency_penalty=-0.4, presence_penalty=1.5), [4], [5, 5, 5, 6]),
        (SamplingParams(repetition_penalty=1.3), [7, 8, 9], [10, 7]),
        (SamplingParams(), [1], [2, 2]),
        (SamplingParams(logit_bias={11: 250.0, 12: -3.5, 3: -1000}), [1], [3]),
        (SamplingParams(repetition_penalty=0.8, frequency_penalty=0.3, logit_bias={8: 2.0}), [8, 20], [21, 21, 8]),
    ]
    requests = []
    for i, (params, prompt, output) in enumerate(cases):
        r = Request(f"r{i}", prompt, params, 16)
        for token in output:
            r.append_output_token(token)
        requests.append(r)
    logits = torch.randn(len(cases), vocab, generator=gen) * 3
    batch = SamplingBatch.from_requests(requests, vocab, torch.device("cpu"))
    processed = batch.process_logits(logits.clone())
    for row, (params, prompt, output) in enumerate(cases):
        expected = reference_logits(logits[row], prompt, output, params.presence_penalty, params.frequency_penalty,
                                    params.repetition_penalty, params.logit_bias)
        torch.testing.assert_close(processed[row], expected, rtol=0, atol=1e-5)
    assert batch.penalties.rows.tolist() == [0, 1, 2, 5]  # only the rows that asked pay for penalties
    assert torch.equal(processed[3], logits[3])


def test_a_batch_without_penalties_or_bias_builds_neither():
    requests = [Request("a", [1, 2], SamplingParams(temperature=0.5), 16)]
    batch = SamplingBatch.from_requests(requests, 8, torch.device("cpu"))
    assert batch.penalties is None and batch.logit_bias is None and batch.grammar is None
    logits = torch.randn(1, 8)
    assert torch.equal(batch.process_logits(logits.clone()), logits)


def test_logit_bias_of_100_forces_the_token_and_minus_100_bans_it():
    requests = [Request("a", [1], SamplingParams(temperature=0, logit_bias={4: 100}), 16),
                Request("b", [1], SamplingParams(temperature=1.0, logit_bias={0: -100}), 16)]
    logits = PROBS.log().repeat(2, 1)
    for _ in range(20):
        tokens, _ = Sampler()(logits.clone(), SamplingBatch.from_requests(requests, 5, torch.device("cpu")))
        assert tokens[0] == 4 and tokens[1] != 0


def test_draws_never_land_on_a_zero_weight_token_and_follow_the_weights_on_a_large_vocabulary():
    from engine.sampler import sample_from

    vocab = 49152
    weights = torch.zeros(64, vocab)
    weights[:, 1000] = 3.0  # the first and last tokens, and everything else, weigh nothing
    weights[:, 40000] = 1.0
    weights[:, vocab - 2] = 1e-30  # still drawable, in principle, but never in practice
    counts = torch.zeros(vocab)
    for _ in range(50):
        for token in sample_from(weights, []).tolist():
            counts[token] += 1
    assert counts.sum() == 64 * 50 and set(counts.nonzero().flatten().tolist()) <= {1000, 40000, vocab - 2}
    assert math.isclose(counts[1000] / counts.sum(), 0.75, abs_tol=0.04)


@pytest.mark.parametrize("vocab", [1000, 1025, 5000])
def test_the_two_level_inversion_draws_what_one_cumulative_sum_over_the_row_draws(vocab):
    from engine.sampler import sample_from

    gen = torch.Generator().manual_seed(vocab)
    weights = torch.rand(256, vocab, generator=gen) ** 4
    weights[weights < 0.05] = 0.0  # zero-weight runs, some across block edges
    weights[:, -1] = 1.0  # the last real token, beside the padded tail of its block
    weights[7] = 0.0
    weights[7, 1023 % vocab] = 1.0  # a row with one drawable token
    seeds = [(row, torch.Generator().manual_seed(1000 + row)) for row in range(256)]
    drawn = sample_from(weights, seeds)
    uniform = torch.cat([torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(1000 + row))
                         for row in range(256)]).unsqueeze(1)
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    expected = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1)
    # The same draws but where a block's float32 sum rounds a boundary by ~1e-7 of its weight.
    assert (drawn == expected).float().mean() >= 0.99
    assert drawn[7] == 1023 % vocab and bool((weights[torch.arange(256), drawn] > 0).all())


def test_greedy_and_sampled_rows_mix_in_one_batch():
    requests = [Request(f"r{i}", [1], SamplingParams(temperature=0 if i % 2 else 1.0, seed=i), 16) for i in range(8)]
    logits = PROBS.log().repeat(8, 1)
    tokens, _ = Sampler()(logits, SamplingBatch.from_requests(requests, 5, torch.device("cpu")))
    assert all(tokens[i] == 0 for i in range(1, 8, 2))
    again, _ = Sampler()(logits, SamplingBatch.from_requests(
        [Request(f"r{i}", [1], SamplingParams(temperature=0 if i % 2 else 1.0, seed=i), 16) for i in range(8)],
        5, torch.device("cpu")))
    assert again == tokens  # seeded rows draw the same again


def test_huge_temperature_with_banned_tokens_draws_uniformly_among_the_allowed():
    requests = [Request(f"r{i}", [1], SamplingParams(temperature=1e300, min_tokens=2), 16, eos_token_ids=(0,))
                for i in range(2000)]
    logits = PROBS.log().repeat(2000, 1)
    tokens, _ = Sampler()(logits, SamplingBatch.from_requests(requests, 5, torch.device("cpu")))
    freq = torch.bincount(torch.tensor(tokens), minlength=5).float() / 2000
    assert freq[0] == 0 and torch.allclose(freq[1:], torch.full((4,), 0.25), atol=0.04)

