"""The native CPU sampler (engine/kernels/sampling_cpu.cpp) on its own: its draws against the row's float64
cumulative softmax, its argmax against torch's. tests/test_sampler.py runs the Sampler on it and on torch's ops."""
from __future__ import annotations

import pytest
import torch


def native_or_skip():
    from engine.kernels import native_sampler_available, sample_rows

    if not native_sampler_available():
        pytest.skip("the native CPU kernels are not available here")
    return sample_rows


@pytest.mark.parametrize("vocab", [1000, 1025, 5000, 49152])
def test_the_native_draw_inverts_the_rows_cumulative_softmax(vocab):
    sample_rows = native_or_skip()
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(128, vocab, generator=gen) * 3
    logits[torch.rand(128, vocab, generator=gen) < 0.3] = float("-inf")  # banned runs, some across block edges
    logits[:, -1] = 2.0  # the last real token, beside the padded tail of its block
    logits[5] = float("-inf")
    logits[5, 1023 % vocab] = 0.0  # a row with one drawable token
    temperature = torch.rand(128, generator=gen) * 1.5 + 0.05
    uniform = torch.rand(128, dtype=torch.float64, generator=gen)
    drawn = sample_rows(logits, temperature, uniform)
    weights = torch.softmax(logits.double() / temperature.double().unsqueeze(1), dim=-1)
    cdf = weights.cumsum(dim=-1)
    expected = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    # The same draws but where the fp32 weights round a boundary by ~1e-6 of a block's weight.
    assert (drawn == expected).float().mean() >= 0.99
    assert drawn[5] == 1023 % vocab and bool((logits[torch.arange(128), drawn] > float("-inf")).all())
    assert drawn.tolist() == sample_rows(logits, temperature, uniform).tolist()  # deterministic at a given draw


def test_the_native_argmax_is_torchs_on_ties_nan_and_infinities():
    sample_rows = native_or_skip()
    vocab = 1000 + 7  # not a multiple of 16 or 32: the tails
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, [10, 500, 1006]] = 9.0  # ties: the first
    logits[1, 1006] = 9.0  # in the tail
    logits[2, [40, 900]] = float("nan")  # the first NaN, as torch
    logits[3, [41, 901]] = float("inf")  # the first +inf
    logits[4] = float("-inf")  # every token banned: index 0
    logits[5, 3] = float("nan")
    logits[5, 2] = float("inf")
    greedy = sample_rows(logits, torch.zeros(8), torch.zeros(8, dtype=torch.float64))
    assert greedy.tolist() == logits.argmax(dim=-1).tolist()
    assert greedy.tolist()[:6] == [10, 1006, 40, 41, 0, 3]
    # A sampling row with a NaN or +inf logit takes the same token; one with all tokens banned, index 0.
    sampled = sample_rows(logits, torch.ones(8), torch.full((8,), 0.5, dtype=torch.float64))
    assert sampled.tolist()[2:6] == [40, 41, 0, 3]


def test_the_native_sampler_reads_strided_rows():
    sample_rows = native_or_skip()
    wide = torch.randn(4, 3000, generator=torch.Generator().manual_seed(1))
    rows = wide[:, :2500]  # stride(0) 3000, not the vocabulary
    uniform = torch.rand(4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    temperature = torch.tensor([0.0, 1.0, 0.5, 2.0])
    assert sample_rows(rows, temperature, uniform).tolist() == \
        sample_rows(rows.contiguous(), temperature, uniform).tolist()
    assert sample_rows(rows, temperature, uniform)[0] == rows[0].argmax()
