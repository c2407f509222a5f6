"""Attention backends agree with each other and with dense causal attention, in fp32 and bf16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, CpuAttention, PrefillChunk, TorchAttention
from engine.kernels import cpu_kernels_available

H, KVH, BS = 6, 2, 4


def dense_reference(q, k, v):
    """Causal attention over one whole sequence; q [T, H, D], k/v [T, KVH, D] -> [T, H*D]."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                       v.transpose(0, 1).unsqueeze(0), is_causal=True, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1).reshape(q.shape[0], -1)


def run_mixed_step(backend_cls, dtype, D):
    """Two decodes (contexts 9 and 17) and one prefill chunk with 5 cached tokens, in one step."""
    torch.manual_seed(0)
    backend = backend_cls(H, KVH, D, BS)
    k_cache = torch.zeros(backend.kv_cache_shape(32), dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    lengths, new = [9, 17, 12], [1, 1, 7]
    tables = [[3, 7, 1], [10, 2, 5, 8, 11], [20, 21, 22]]
    seqs = [(torch.randn(n, H, D, dtype=dtype), torch.randn(n, KVH, D, dtype=dtype),
             torch.randn(n, KVH, D, dtype=dtype)) for n in lengths]
    # Fill the cached part of each sequence through a first step of prefills.
    first_slots, qs, ks, vs, chunks, start = [], [], [], [], [], 0
    for (q, k, v), n_total, n_new, table in zip(seqs, lengths, new, tables):
        cached = n_total - n_new
        first_slots += [table[p // BS] * BS + p % BS for p in range(cached)]
        qs.append(q[:cached]); ks.append(k[:cached]); vs.append(v[:cached])
        chunks.append(PrefillChunk(start, cached, 0, None))
        start += cached
    backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache,
                    AttentionMetadata(torch.tensor(first_slots), 0, prefills=chunks))
    # The mixed step.
    slots, qs, ks, vs = [], [], [], []
    for (q, k, v), n_total, n_new, table in zip(seqs, lengths, new, tables):
        slots += [table[p // BS] * BS + p % BS for p in range(n_total - n_new, n_total)]
        qs.append(q[-n_new:]); ks.append(k[-n_new:]); vs.append(v[-n_new:])
    meta = AttentionMetadata(torch.tensor(slots), 2,
                             decode_block_tables=torch.tensor([[3, 7, 1, 0, 0], tables[1]]),
                             decode_seq_lens=torch.tensor([9, 17]),
                             prefills=[PrefillChunk(2, 7, 5, torch.tensor(tables[2]))])
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta)
    expected = torch.cat([dense_reference(*[t.float() for t in s])[-n:] for s, n in zip(seqs, new)])
    return out.float(), expected


@pytest.mark.parametrize("head_dim", [32, 64, 128])  # 64 and 128 take the vectorised kernel where there is one
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("backend_cls", [TorchAttention, pytest.param(CpuAttention, marks=pytest.mark.skipif(
    not cpu_kernels_available(), reason="no C++ toolchain here to build the native CPU kernels"))])
def test_mixed_decode_and_chunked_prefill_match_dense_attention(backend_cls, dtype, tol, head_dim):
    out, expected = run_mixed_step(backend_cls, dtype, head_dim)
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
