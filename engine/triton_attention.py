"""Paged attention in Triton: the KV store, split-context decode with its reduction, and varlen prefill.

The cache is ``[num_blocks, block_size, num_kv_heads, head_dim]`` (one token's K for every head contiguous, as
vLLM's and flash-attn's paged layouts): the store writes one contiguous row per token, and a tile of keys for one
head is ``TILE`` rows of ``head_dim`` contiguous values. Tiles gather their tokens' block ids from the block
table one by one, so any block size works and a tile may span blocks.

Decode (one query token per sequence) runs one program per (sequence, KV head, context split): the program
holds the whole GQA group's queries, so each KV tile is read once for the group. Splits write a partial output
and its log-sum-exp; a second kernel merges them (flash-decoding). The split count is fixed per launch and the
context each split covers is worked out in the kernel from the sequence's length, so a launch has no
data-dependent shape and replays inside a CUDA graph.

Prefill and chunked prefill run one program per (sequence, tile of query tokens, KV head) over the block table:
the chunk's own K/V are stored first, so context and chunk are read alike, with the causal mask at
``context_len + query index``. Rows of a program are (query token, head of the group) pairs.

With ``TRITON_INTERPRET=1`` set before this module is imported, the kernels run on CPU tensors (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

DECODE_TILE = 64  # keys per decode iteration
PREFILL_TILE = 64  # keys per prefill iteration
PREFILL_ROWS = 64  # (query token, head) rows per prefill program
MAX_SPLITS = 16
MIN_TOKENS_PER_SPLIT = 128  # a shorter split costs more in its reduction than it saves
LOG2E = 1.4426950408889634


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_k, stride_v, stride_cb, stride_ct,
                     block_size, ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # a padded row (CUDA-graph buckets): nothing to store
        return
    cols = tl.arange(0, ROW_PAD)
    mask = cols < ROW
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_ct + cols
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + token * stride_k + cols, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + token * stride_v + cols, mask=mask), mask=mask)


@triton.jit
def _attend_tile(q, k_cache_ptr, v_cache_ptr, table, pos, valid, visible, kv_head, d, qk_scale, m, l, acc,
                 stride_cb, stride_ct, stride_ch, block_size, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step over the keys at `pos` (their blocks looked up in `table`); scores in log2 units."""
    block = tl.load(table + pos // block_size, mask=valid, other=0).to(tl.int64)
    offs = block[:, None] * stride_cb + (pos % block_size)[:, None] * stride_ct + kv_head * stride_ch + d[None, :]
    kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [rows, TILE]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l * alpha + tl.sum(p, 1), acc


@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, part_out_ptr,
                         part_lse_ptr, qk_scale, stride_qt, stride_qh, stride_cb, stride_ct, stride_ch, stride_bt,
                         stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, block_size,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                         TILE: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g
    d = tl.arange(0, D_PAD)
    q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)

    num_tiles = tl.cdiv(seq_len, TILE)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, num_tiles)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for tile in range(first, last):
        pos = tile * TILE + tl.arange(0, TILE)
        valid = pos < seq_len
        m, l, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, table, pos, valid, valid[None, :], kv_head, d,
                                 qk_scale, m, l, acc, stride_cb, stride_ct, stride_ch, block_size, HEAD_DIM, PRECISION)
    has = l > 0  # an empty split (a short context, or a padded row) contributes nothing
    out = acc / tl.where(has, l, 1.0)[:, None]
    lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
    tl.store(part_out_ptr + seq * stride_pt + heads[:, None] * stride_ph + split * stride_ps + d[None, :], out,
             mask=q_mask)
    tl.store(part_lse_ptr + seq * stride_lt + heads * stride_lh + split, lse, mask=g < GROUP)


@triton.jit
def _decode_reduce_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
                          stride_ot, stride_oh, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    lse = tl.load(part_lse_ptr + seq * stride_lt + head * stride_lh + s, mask=s < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(top > float("-inf"), top, 0.0))
    total = tl.sum(weight, 0)
    mask = (s < NUM_SPLITS)[:, None] & (d < HEAD_DIM)[None, :]
    parts = tl.load(part_out_ptr + seq * stride_pt + head * stride_ph + s[:, None] * stride_ps + d[None, :],
                    mask=mask, other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
                    first_seq, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch,
                    stride_bt, block_size, GROUP: tl.constexpr, QUERIES: tl.constexpr, ROWS: tl.constexpr,
                    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr):
    seq = first_seq + tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_tile * QUERIES >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len
    r = tl.arange(0, ROWS)
    qi = q_tile * QUERIES + r // GROUP
    heads = kv_head * GROUP + r % GROUP
    row_ok = (r < QUERIES * GROUP) & (qi < q_len)
    d = tl.arange(0, D_PAD)
    q_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + (q_start + qi)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask,
                other=0.0)
    q_pos = context + qi  # each row's position in its sequence: it sees keys at or before it

    # Keys past the last query of this tile are masked for every row: stop there.
    kv_end = tl.minimum(seq_len, context + tl.minimum(q_len, (q_tile + 1) * QUERIES))
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for tile in range(0, tl.cdiv(kv_end, TILE)):
        pos = tile * TILE + tl.arange(0, TILE)
        valid = pos < kv_end
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])  # key 0 is visible to every row: m stays finite
        m, l, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, table, pos, valid, visible, kv_head, d, qk_scale, m, l,
                                 acc, stride_cb, stride_ct, stride_ch, block_size, HEAD_DIM, PRECISION)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + (q_start + qi)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _precision(dtype: torch.dtype) -> str:
    # fp32 keeps IEEE products (tf32 would lose the parity with the torch backend); 16-bit inputs ignore it.
    return "ieee" if dtype == torch.float32 else "tf32"


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k/v [N, KVH, D] into the cache at their slots; rows whose slot is negative are skipped."""
    n, kv_heads, head_dim = k.shape
    row = kv_heads * head_dim
    k, v = k.reshape(n, row), v.reshape(n, row)
    if k.stride(1) != 1:
        k = k.contiguous()
    if v.stride(1) != 1:
        v = v.contiguous()
    if n == 0:
        return
    _store_kv_kernel[(n,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), k_cache.stride(0),
                           k_cache.stride(1), k_cache.shape[1], ROW=row, ROW_PAD=triton.next_power_of_2(row))


def decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many context splits fill the GPU twice over, with at least MIN_TOKENS_PER_SPLIT tokens each."""
    wanted = triton.cdiv(2 * num_sms, max(1, num_seqs * num_kv_heads))
    by_length = triton.cdiv(max(1, max_seq_len), MIN_TOKENS_PER_SPLIT)
    return max(1, min(MAX_SPLITS, triton.next_power_of_2(wanted), triton.next_power_of_2(by_length)))


def paged_decode(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, num_splits: int) -> None:
    """One query token per sequence: q and out [B, H, D]; seq_lens include the new token (0: a padded row)."""
    b, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    d_pad = triton.next_power_of_2(head_dim)
    part_out = torch.empty(b, num_heads, num_splits, d_pad, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(b, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(b, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse, scale * LOG2E, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), part_out.stride(0),
        part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1), k_cache.shape[1],
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, D_PAD=d_pad,
        TILE=DECODE_TILE, NUM_SPLITS=num_splits, PRECISION=_precision(q.dtype), num_warps=4)
    _decode_reduce_kernel[(b, num_heads)](
        part_out, part_lse, out, part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0),
        part_lse.stride(1), out.stride(0), out.stride(1), HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SPLITS=num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4)


def paged_prefill(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, first_seq: int,
                  num_seqs: int, max_query_len: int, scale: float) -> None:
    """Sequences first_seq .. first_seq + num_seqs of a varlen batch: q and out [N, H, D] (all tokens)."""
    _, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    rows = max(PREFILL_ROWS, triton.next_power_of_2(group))
    queries = rows // group
    grid = (num_seqs, triton.cdiv(max_query_len, queries), kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, first_seq, scale * LOG2E, q.stride(0),
        q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), k_cache.shape[1], GROUP=group, QUERIES=queries, ROWS=rows, HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim), TILE=PREFILL_TILE, PRECISION=_precision(q.dtype), num_warps=4)
