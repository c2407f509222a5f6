"""Attention over a paged KV cache, behind one interface with a `torch` and a `flash-attn` backend.

The cache of one layer is a pair of tensors shaped ``[num_blocks, block_size, num_kv_heads, head_dim]``;
viewed flat, token slot ``s`` lives at ``s // block_size, s % block_size``. A step's tokens come flattened:
first one token per decoding request, then each prefilling request's chunk.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass
class PrefillChunk:
    query_start: int  # offset of its first token in the flattened batch
    query_len: int
    context_len: int  # tokens already in the cache before this chunk
    kv_slots: torch.Tensor | None  # slots of positions [0, context_len + query_len) when context_len > 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    num_decodes: int
    # Decodes, batched: slots of every cached position (padded) and which of them are real.
    decode_slots: torch.Tensor | None = None  # [num_decodes, max_seq_len]
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_seq_len] bool
    prefills: list[PrefillChunk] = field(default_factory=list)
    # For kernels that read the cache through block tables (flash-attn).
    seq_lens: torch.Tensor | None = None  # [num_requests] context after this step, decodes first
    query_start_loc: torch.Tensor | None = None  # [num_requests + 1]
    block_tables: torch.Tensor | None = None  # [num_requests, max_blocks]
    max_query_len: int = 1
    max_seq_len: int = 0


class AttentionBackend:
    name = "base"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [N, H, D], k/v [N, KVH, D] for the step's new tokens; returns [N, H * D]."""
        raise NotImplementedError


class TorchAttention(AttentionBackend):
    """Gathers K/V through the slot tables and calls SDPA: runs on any device torch runs on."""

    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta):
        k_flat = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        v_flat = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        # All writes precede all reads, so a request may read blocks another one fills in this same step.
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_flat, v_flat, meta)
        for chunk in meta.prefills:
            s, n = chunk.query_start, chunk.query_len
            out[s:s + n] = self._prefill(q[s:s + n], k[s:s + n], v[s:s + n], k_flat, v_flat, chunk)
        return out

    def _decode(self, q, k_flat, v_flat, meta):
        b = q.shape[0]
        # One query token per request: fold the GQA group into the query axis, no K/V repeat needed.
        qg = q.view(b, self.num_kv_heads, self.group, self.head_dim)
        keys = k_flat[meta.decode_slots].transpose(1, 2)  # [B, KVH, L, D]
        values = v_flat[meta.decode_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=meta.decode_mask, scale=self.scale)
        return o.reshape(b, self.num_heads * self.head_dim)

    def _prefill(self, q, k, v, k_flat, v_flat, chunk: PrefillChunk):
        n = q.shape[0]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if chunk.context_len == 0:
            kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            kh = k_flat[chunk.kv_slots].transpose(0, 1).unsqueeze(0)
            vh = v_flat[chunk.kv_slots].transpose(0, 1).unsqueeze(0)
            total = chunk.context_len + n
            rows = torch.arange(n, device=q.device).unsqueeze(1) + chunk.context_len
            mask = torch.arange(total, device=q.device).unsqueeze(0) <= rows
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1).reshape(n, self.num_heads * self.head_dim)


class FlashAttention(AttentionBackend):
    """flash-attn's varlen kernel reading the paged cache through block tables (CUDA only)."""

    name = "flash-attn"

    def __init__(self, num_heads, num_kv_heads, head_dim):
        super().__init__(num_heads, num_kv_heads, head_dim)
        from flash_attn import flash_attn_varlen_func  # optional dependency: the `gpu` extra
        self._varlen = flash_attn_varlen_func

    def forward(self, q, k, v, k_cache, v_cache, meta):
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        cu_k = F.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        o = self._varlen(q, k_cache, v_cache, cu_seqlens_q=meta.query_start_loc, cu_seqlens_k=cu_k,
                         max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_seq_len,
                         softmax_scale=self.scale, causal=True, block_table=meta.block_tables)
        return o.reshape(q.shape[0], self.num_heads * self.head_dim)


def select_backend(name: str, device: torch.device, num_heads: int, num_kv_heads: int,
                   head_dim: int, block_size: int) -> AttentionBackend:
    if name == "auto":
        name = "torch"
        if device.type == "cuda" and block_size % 256 == 0:
            try:
                import flash_attn  # noqa: F401
                name = "flash-attn"
            except ImportError:
                log.info("flash-attn is not installed; using the torch attention backend")
    if name == "torch":
        return TorchAttention(num_heads, num_kv_heads, head_dim)
    if name == "flash-attn":
        if device.type != "cuda":
            raise ValueError("the flash-attn backend needs a CUDA device")
        if block_size % 256:
            raise ValueError(f"flash-attn's paged KV needs block_size a multiple of 256, got {block_size}")
        return FlashAttention(num_heads, num_kv_heads, head_dim)
    raise ValueError(f"unknown attention backend {name!r}; use auto, torch or flash-attn")
