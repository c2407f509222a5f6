"""The batched sampler on hand-made logits: each filter keeps exactly the tokens it should."""
from __future__ import annotations

import math

import torch

from engine.request import Request
from engine.sampler import Sampler, SamplingBatch
from engine.sampling_params import SamplingParams

PROBS = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])


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
        logits = torch.randn(batch_size, 1000, generator=torch.Generator().manual_seed(0))
        logits[:] = logits[0]
        tokens = []
        sampler = Sampler()
        for _ in range(5):
            tokens.append(sampler(logits.clone(), SamplingBatch.from_requests(reqs, 1000, torch.device("cpu")))[0][0])
        return tokens
    assert sample(1) == sample(9)
