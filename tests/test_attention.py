"""Attention backends agree with each other and with dense causal attention, in fp32 and bf16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, CpuAttention, PrefillChunk, TorchAttention
from engine.kernels import cpu_kernels_available, packed_keys_supported, plain_token_rows_supported

H, KVH = 6, 2  # a GQA group of 3


def dense_reference(q, k, v):
    """Causal attention over one whole sequence; q [T, H, D], k/v [T, KVH, D] -> [T, H*D]."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                       v.transpose(0, 1).unsqueeze(0), is_causal=True, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1).reshape(q.shape[0], -1)


def run_mixed_step(backend, dtype, scale=1, token_rows=False):
    """Two decodes (contexts 9 and 17, times `scale`) and one prefill chunk of 7 tokens after cached ones, in one
    step, over shuffled blocks. `token_rows`: also each token's block table and position, as the runner gives
    backends that read them."""
    torch.manual_seed(0)
    H, KVH, D, BS = backend.num_heads, backend.num_kv_heads, backend.head_dim, backend.block_size
    k_cache = torch.zeros(backend.key_cache_shape(32 * scale), dtype=dtype)
    v_cache = torch.zeros(backend.kv_cache_shape(32 * scale), dtype=dtype)
    lengths, new = [9 * scale, 17 * scale, 12 * scale], [1, 1, 7]
    blocks = torch.randperm(32 * scale).tolist()  # shuffled, as a used pool is
    tables = [blocks[0:3 * scale], blocks[3 * scale:8 * scale], blocks[8 * scale:11 * scale]]
    tables = [t[:-(-n // BS)] for t, n in zip(tables, lengths)]
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
    width = max(len(tables[0]), len(tables[1]))
    meta = AttentionMetadata(torch.tensor(slots), 2,
                             decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables[:2]]),
                             decode_seq_lens=torch.tensor(lengths[:2]),
                             prefills=[PrefillChunk(2, 7, lengths[2] - 7, torch.tensor(tables[2]))])
    if token_rows:
        full = [t + [0] * (max(map(len, tables)) - len(t)) for t in tables]
        meta.token_block_tables = torch.tensor([full[r] for r, n in enumerate(new) for _ in range(n)])
        meta.token_positions = torch.tensor([p for n_total, n in zip(lengths, new) for p in range(n_total - n, n_total)])
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta)
    expected = torch.cat([dense_reference(*[t.float() for t in s])[-n:] for s, n in zip(seqs, new)])
    return out.float(), expected


@pytest.mark.parametrize("head_dim", [32, 64, 128])  # 64 and 128 take the vectorised kernel where there is one
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("backend_cls", [TorchAttention, pytest.param(CpuAttention, marks=pytest.mark.skipif(
    not cpu_kernels_available(), reason="no C++ toolchain here to build the native CPU kernels"))])
def test_mixed_decode_and_chunked_prefill_match_dense_attention(backend_cls, dtype, tol, head_dim):
    out, expected = run_mixed_step(backend_cls(H, KVH, head_dim, 4), dtype)
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


@pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ toolchain here to build the native CPU kernels")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (6, 3), (6, 2), (8, 2), (7, 1)])  # groups of 1, 2, 3, 4 and 7
@pytest.mark.parametrize("block_size", [16, 6])
def test_bf16_decode_rows_in_the_plain_layout_match_dense_attention(head_dim, heads, block_size):
    """The decode kernel on bf16 K/V in the plain layout (the vectorised one where the CPU has AVX-512 or AVX2):
    query heads of a GQA group taken three at a time with the rest after, contexts of 1 to 37 tokens (whole and
    partial runs of 4 tokens, several blocks; blocks of 6 tokens end in a partial run of 4 too), and a row with
    nothing to attend to, which gives zeros."""
    torch.manual_seed(1)
    num_heads, num_kv_heads = heads
    lengths = [1, 3, 4, 5, 17, 37, 0]
    per_row = -(-max(lengths) // block_size)
    pool = len(lengths) * per_row + 3
    tables = torch.randperm(pool)[:len(lengths) * per_row].view(len(lengths), per_row)
    k_cache = torch.randn(pool, num_kv_heads, block_size, head_dim).to(torch.bfloat16)
    v_cache = torch.randn(pool, num_kv_heads, block_size, head_dim).to(torch.bfloat16)
    q = torch.randn(len(lengths), num_heads, head_dim).to(torch.bfloat16)
    out = torch.empty(len(lengths), num_heads * head_dim, dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    torch.ops.tokenline.paged_decode_attention(out, q, k_cache, v_cache, tables, torch.tensor(lengths), scale)
    for row, n in enumerate(lengths):
        if n == 0:
            assert not out[row].float().any()
            continue
        slots = [(int(tables[row, t // block_size]), t % block_size) for t in range(n)]
        k = torch.stack([k_cache[b, :, o] for b, o in slots]).float()  # [n, KVH, D]
        v = torch.stack([v_cache[b, :, o] for b, o in slots]).float()
        keys, values = (x.repeat_interleave(num_heads // num_kv_heads, dim=1) for x in (k, v))
        weights = torch.softmax(torch.einsum("hd,thd->ht", q[row].float() * scale, keys), dim=-1)
        expected = torch.einsum("ht,thd->hd", weights, values).reshape(-1)
        torch.testing.assert_close(out[row].float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not plain_token_rows_supported(64), reason="no AVX2 attention kernel here: keys are packed "
                                                              "(AVX512-BF16), or rows wait for SDPA")
@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (128, 16), (64, 32)])
@pytest.mark.parametrize("scale", [1, 5])
def test_bf16_token_rows_in_the_plain_layout_match_dense_attention(head_dim, block_size, scale):
    """Where the CPU has AVX2 but not AVX-512, bf16 keys stay in the plain layout and every new token of a step,
    prompt rows too, is a row of the native kernel."""
    plain = CpuAttention(9, 3, head_dim, block_size, torch.bfloat16)
    assert not plain.packed_keys and plain.uses_token_rows
    out, expected = run_mixed_step(plain, torch.bfloat16, scale, token_rows=True)
    by_sdpa, _ = run_mixed_step(plain, torch.bfloat16, scale, token_rows=False)  # prompt rows by SDPA
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out, by_sdpa, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not packed_keys_supported(16, 64, 3), reason="this CPU has no AVX512-BF16 (or no C++ toolchain): "
                                                                   "keys stay in the plain layout")
@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (128, 16), (64, 32)])
@pytest.mark.parametrize("scale", [1, 5])  # contexts up to 85 tokens: several blocks, partial last ones
@pytest.mark.parametrize("token_rows", [False, True])  # prefill chunks by SDPA, or every token by the native kernel
def test_packed_bf16_keys_give_the_same_attention_as_the_plain_layout(head_dim, block_size, scale, token_rows):
    packed = CpuAttention(9, 3, head_dim, block_size, torch.bfloat16)
    assert packed.packed_keys and packed.key_cache_shape(2) == (2, 3, head_dim // 2, block_size, 2)
    assert packed.uses_token_rows
    out, expected = run_mixed_step(packed, torch.bfloat16, scale, token_rows)  # SmolLM2's GQA group of 3
    plain, _ = run_mixed_step(TorchAttention(9, 3, head_dim, block_size), torch.bfloat16, scale)
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out, plain, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ toolchain here to build the native CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_prefill_as_token_rows_is_split_between_threads_by_work_with_the_same_result(dtype):
    """Rows of a causal prefill grow in length: the kernel splits them by work, not by count; every row is its
    own item, so any split gives the same bits."""
    from engine import kernels

    torch.manual_seed(0)
    n, D, BS = 150, 64, 16
    k_cache = torch.zeros(CpuAttention(9, 3, D, BS, dtype).key_cache_shape(16), dtype=dtype)
    v_cache = torch.zeros(16, 3, BS, D, dtype=dtype)
    q, k, v = torch.randn(n, 9, D, dtype=dtype), torch.randn(n, 3, D, dtype=dtype), torch.randn(n, 3, D, dtype=dtype)
    blocks = torch.randperm(16)[:-(-n // BS)]
    kernels.write_kv_cache(k, v, k_cache, v_cache, blocks.repeat_interleave(BS)[:n] * BS + torch.arange(n) % BS)
    tables, lens = blocks.unsqueeze(0).expand(n, -1).contiguous(), torch.arange(1, n + 1)
    threads, outs = torch.get_num_threads(), []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            out = torch.empty(n, 9 * D, dtype=dtype)
            kernels.paged_decode_attention(out, q, k_cache, v_cache, tables, lens, D ** -0.5)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(outs[0].float(), dense_reference(q.float(), k.float(), v.float()), atol=tol, rtol=tol)


@pytest.mark.skipif(not packed_keys_supported(16, 64, 3), reason="this CPU has no AVX512-BF16 (or no C++ toolchain): "
                                                                   "keys stay in the plain layout")
def test_a_long_context_free_prompt_chunk_by_sdpa_beside_token_rows_gives_the_same_attention():
    """Where the CPU has AMX, a prompt chunk of sdpa_min_tokens or more with no context runs in SDPA; the rows
    around it (decodes, a chunk with context, a short chunk) stay on the native kernel."""
    from engine import kernels

    torch.manual_seed(0)
    D, BS, dtype = 64, 16, torch.bfloat16
    backend = CpuAttention(9, 3, D, BS, dtype)
    SDPA_MIN_TOKENS = backend.sdpa_min_tokens
    # a decode at context 20, a long fresh prompt, a chunk of 5 after 30 cached tokens, a short fresh prompt
    lengths, new, cached = [21, SDPA_MIN_TOKENS + 9, 35, 7], [1, SDPA_MIN_TOKENS + 9, 5, 7], [20, 0, 30, 0]
    pool = 8 + sum(-(-n // BS) for n in lengths)
    k_cache, v_cache = torch.zeros(backend.key_cache_shape(pool), dtype=dtype), torch.zeros(pool, 3, BS, D, dtype=dtype)
    seqs = [tuple(torch.randn(n, h, D, dtype=dtype) for h in (9, 3, 3)) for n in lengths]
    tables, free = [], torch.randperm(pool).tolist()
    for n in lengths:
        tables.append(free[:-(-n // BS)])
        free = free[-(-n // BS):]
    width = max(map(len, tables))

    def slots(table, positions):
        return torch.tensor([table[p // BS] * BS + p % BS for p in positions])

    for (_, k, v), table, c in zip(seqs, tables, cached):  # the cached context, written before the step
        if c:
            kernels.write_kv_cache(k[:c], v[:c], k_cache, v_cache, slots(table, range(c)))
    rows = [range(c, c + n) for c, n in zip(cached, new)]
    q = torch.cat([s[0][r.start:r.stop] for s, r in zip(seqs, rows)])
    k = torch.cat([s[1][r.start:r.stop] for s, r in zip(seqs, rows)])
    v = torch.cat([s[2][r.start:r.stop] for s, r in zip(seqs, rows)])
    starts = [0, 1, 1 + new[1], 1 + new[1] + new[2]]

    def meta():
        m = AttentionMetadata(torch.cat([slots(t, r) for t, r in zip(tables, rows)]), 1,
                              prefills=[PrefillChunk(starts[i], new[i], cached[i],
                                                     torch.tensor(tables[i]) if cached[i] else None)
                                        for i in (1, 2, 3)])
        m.token_block_tables = torch.tensor([tables[i] + [0] * (width - len(tables[i]))
                                             for i, r in enumerate(rows) for _ in r])
        m.token_positions = torch.tensor([p for r in rows for p in r])
        return m

    backend.sdpa_prefill = False
    rows_only = backend.forward(q, k, v, k_cache, v_cache, meta())
    backend.sdpa_prefill = True
    split = backend.forward(q, k, v, k_cache, v_cache, meta())
    expected = torch.cat([dense_reference(*[t.float() for t in s])[r.start:r.stop] for s, r in zip(seqs, rows)])
    torch.testing.assert_close(split.float(), expected, atol=3e-2, rtol=3e-2)
    long = slice(starts[1], starts[2])
    assert not torch.equal(split[long], rows_only[long])  # SDPA's rounding, not the kernel's
    for other in (slice(0, 1), slice(starts[2], None)):  # the rows around it: the native kernel's bits
        assert torch.equal(split[other], rows_only[other])


def _attention_amx() -> bool:
    from engine.kernels import native_attention_amx

    return native_attention_amx()


# The query tiles on AVX512-BF16's vdpbf16ps, and on AMX where this CPU and build have them.
QUERY_TILE_KERNELS = ["avx512"] + (["amx"] if _attention_amx() else [])


@pytest.fixture(params=QUERY_TILE_KERNELS)
def query_tile_kernel(request):
    """Runs the test on one of the query tiles' kernels, then restores the switch (after the skip marks: a CPU
    without packed keys never gets here)."""
    before = _attention_amx()
    torch.ops.tokenline.attention_amx(1 if request.param == "amx" else 0)
    try:
        yield request.param
    finally:
        torch.ops.tokenline.attention_amx(1 if before else 0)


@pytest.mark.skipif(not packed_keys_supported(16, 64, 3), reason="this CPU has no AVX512-BF16 (or no C++ toolchain): "
                                                                   "keys stay in the plain layout")
@pytest.mark.parametrize("head_dim, block_size, heads", [(64, 16, (9, 3)), (128, 16, (8, 2)), (64, 32, (4, 4)),
                                                         (64, 16, (16, 1)), (64, 48, (9, 3))])
def test_prompt_rows_in_query_tiles_match_the_same_rows_one_by_one_and_dense_attention(head_dim, block_size, heads,
                                                                                        query_tile_kernel):
    """Eight or more consecutive rows of one sequence go through the kernel's query tiles (16 query vectors in
    the lanes of a register, an online softmax); rows in any other order go one by one. Both agree with dense
    attention. The step mixes a decode, a chunk of 37 after 45 cached tokens, a chunk of 18 after 82 whose
    sequence shares its first block with the last (a cached prefix): its rows' lengths carry on from the chunk
    before, but its blocks do not, so it is a run of its own. Last, a chunk of 5: too short for a tile."""
    from engine import kernels

    torch.manual_seed(0)
    H, KVH = heads
    D, BS, dtype = head_dim, block_size, torch.bfloat16
    pool = 48
    k_cache = torch.zeros(CpuAttention(H, KVH, D, BS, dtype).key_cache_shape(pool), dtype=dtype)
    v_cache = torch.zeros(pool, KVH, BS, D, dtype=dtype)
    lengths, new = [30, 82, 100, 12], [1, 37, 18, 5]
    free = torch.randperm(pool).tolist()
    tables = []
    for n in lengths:
        tables.append(free[:-(-n // BS)])
        free = free[-(-n // BS):]
    tables[2][0] = tables[1][0]  # a shared prefix: the first block of both
    seqs = [tuple(torch.randn(n, h, D, dtype=dtype) for h in (H, KVH, KVH)) for n in lengths]
    seqs[2] = (seqs[2][0], torch.cat([seqs[1][1][:BS], seqs[2][1][BS:]]), torch.cat([seqs[1][2][:BS], seqs[2][2][BS:]]))

    def slots(table, positions):
        return torch.tensor([table[p // BS] * BS + p % BS for p in positions])

    for (_, k, v), table, n in zip(seqs, tables, lengths):
        kernels.write_kv_cache(k, v, k_cache, v_cache, slots(table, range(n)))
    rows = [range(n - m, n) for n, m in zip(lengths, new)]
    width = max(map(len, tables))
    q = torch.cat([s[0][r.start:r.stop] for s, r in zip(seqs, rows)])
    block_tables = torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i, r in enumerate(rows) for _ in r])
    lens = torch.tensor([p + 1 for r in rows for p in r])

    def attend(order):
        out = torch.empty(len(order), H * D, dtype=dtype)
        kernels.paged_decode_attention(out, q[order].contiguous(), k_cache, v_cache, block_tables[order].contiguous(),
                                       lens[order].contiguous(), D ** -0.5)
        return torch.empty_like(out).index_copy_(0, order, out)

    tiled = attend(torch.arange(q.shape[0]))
    one_by_one = attend(torch.arange(q.shape[0]).flip(0))  # descending lengths: no run, every row alone
    expected = torch.cat([dense_reference(*[t.float() for t in s])[r.start:r.stop] for s, r in zip(seqs, rows)])
    torch.testing.assert_close(tiled.float(), expected, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(one_by_one.float(), expected, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(tiled.float(), one_by_one.float(), atol=2e-2, rtol=2e-2)
    short = slice(sum(new) - new[3], None)  # the chunk of 5 and the decode went one by one either way
    assert torch.equal(tiled[short], one_by_one[short]) and torch.equal(tiled[:1], one_by_one[:1])
    assert not torch.equal(tiled[1:1 + new[1]], one_by_one[1:1 + new[1]])  # the tiles' own rounding


@pytest.mark.skipif(not packed_keys_supported(16, 64, 3), reason="this CPU has no AVX512-BF16 (or no C++ toolchain): "
                                                                   "keys stay in the plain layout")
@pytest.mark.parametrize("head_dim, heads", [(64, (9, 3)), (128, (8, 2))])
def test_query_tiles_follow_scores_that_climb_from_chunk_to_chunk(head_dim, heads, query_tile_kernel):
    """A prompt whose later keys score ever higher against its queries (scaled, half a unit more per token): each
    chunk of keys raises every row's running max by more than the margin the AMX tiles allow a stale max (8), so the
    online softmax rescales its sums and its output chunk after chunk. Rows still agree with dense attention."""
    from engine import kernels

    torch.manual_seed(0)
    H, KVH = heads
    D, BS, dtype, n = head_dim, 16, torch.bfloat16, 150
    u = torch.randn(D)
    u = u / u.norm()
    q = (u * 4 + 0.1 * torch.randn(n, H, D)).to(dtype)
    climb = (torch.arange(n, dtype=torch.float32) * D ** 0.5 / 8).view(n, 1, 1)
    k = (u * climb + 0.1 * torch.randn(n, KVH, D)).to(dtype)
    v = torch.randn(n, KVH, D).to(dtype)
    blocks = -(-n // BS)
    k_cache = torch.zeros(CpuAttention(H, KVH, D, BS, dtype).key_cache_shape(blocks + 3), dtype=dtype)
    v_cache = torch.zeros(blocks + 3, KVH, BS, D, dtype=dtype)
    table = torch.randperm(blocks + 3)[:blocks]
    slots = torch.tensor([int(table[p // BS]) * BS + p % BS for p in range(n)])
    kernels.write_kv_cache(k, v, k_cache, v_cache, slots)
    out = torch.empty(n, H * D, dtype=dtype)
    kernels.paged_decode_attention(out, q, k_cache, v_cache, table.repeat(n, 1), torch.arange(1, n + 1), D ** -0.5)
    expected = dense_reference(q.float(), k.float(), v.float())
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
