"""Attention over a paged KV cache, behind one interface with `torch`, `cpu`, `triton` and `flash-attn` backends.

Each backend chooses its cache layout per layer. A step's tokens come flattened: first one token per
decoding request, then each prefilling request's chunk. Token slot ``s`` is offset ``s % block_size`` of
block ``s // block_size``.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass
class PrefillChunk:
    query_start: int  # offset of its first token in the flattened batch
    query_len: int
    context_len: int  # tokens already in the cache before this chunk
    block_ids: torch.Tensor | None  # blocks holding positions [0, context_len + query_len), when context_len > 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    num_decodes: int
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] int64, context including the new token
    prefills: list[PrefillChunk] = field(default_factory=list)
    # For kernels that take the whole batch through block tables (flash-attn).
    seq_lens: torch.Tensor | None = None  # [num_requests] context after this step, decodes first
    query_start_loc: torch.Tensor | None = None  # [num_requests + 1]
    block_tables: torch.Tensor | None = None  # [num_requests, max_blocks]
    max_query_len: int = 1
    max_seq_len: int = 0
    # Per new token: its request's block table (int64) and its position (it attends to positions 0..position).
    token_block_tables: torch.Tensor | None = None
    token_positions: torch.Tensor | None = None


class AttentionBackend:
    name = "base"
    # Decode steps may replay from CUDA graphs: no host sync, no data-dependent shape, padded rows skipped.
    supports_cuda_graphs = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_kv_heads, self.block_size, self.head_dim)

    # Reads AttentionMetadata.token_block_tables / token_positions (the runner fills them only for such backends).
    uses_token_rows = False

    def key_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The key cache's shape, where a backend lays keys out unlike values."""
        return self.kv_cache_shape(num_blocks)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [N, H, D], k/v [N, KVH, D] for the step's new tokens; returns [N, H * D]."""
        raise NotImplementedError


class TorchAttention(AttentionBackend):
    """Plain PyTorch on any device: copies a request's blocks out of the cache, then calls SDPA or matmuls.

    The cache is ``[blocks, kv_heads, block_size, head_dim]`` so one block of one head is contiguous.
    """

    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta):
        blocks, offsets = meta.slot_mapping // self.block_size, meta.slot_mapping % self.block_size
        # All writes precede all reads, so a request may read blocks another one fills in this same step.
        k_cache[blocks, :, offsets] = k
        v_cache[blocks, :, offsets] = v
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd].contiguous(), k_cache, v_cache, meta).reshape(nd, -1)
        for chunk in meta.prefills:
            s, n = chunk.query_start, chunk.query_len
            out[s:s + n] = self._prefill(q[s:s + n], k[s:s + n], v[s:s + n], k_cache, v_cache, chunk)
        return out

    def _gather_keys(self, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        return self._gather(cache, block_ids)

    def _gather(self, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """[..., nblocks] block ids -> [..., kv_heads, nblocks * block_size, head_dim]."""
        lead = block_ids.shape[:-1]
        g = cache.index_select(0, block_ids.reshape(-1)).view(*lead, block_ids.shape[-1], self.num_kv_heads,
                                                               self.block_size, self.head_dim)
        g = g.movedim(-3, -4)
        return g.reshape(*lead, self.num_kv_heads, -1, self.head_dim)

    def _decode(self, q, k_cache, v_cache, meta):
        b = q.shape[0]
        # One query token per request: fold the GQA group into the query axis, no K/V repeat needed.
        qg = q.view(b, self.num_kv_heads, self.group, self.head_dim)
        keys = self._gather_keys(k_cache, meta.decode_block_tables)  # [B, KVH, L, D]
        values = self._gather(v_cache, meta.decode_block_tables)
        positions = torch.arange(keys.shape[2], device=q.device)
        valid = (positions.unsqueeze(0) < meta.decode_seq_lens.unsqueeze(1)).view(b, 1, 1, -1)
        scores = (qg @ keys.transpose(-1, -2)).float() * self.scale
        probs = scores.masked_fill(~valid, float("-inf")).softmax(dim=-1).to(q.dtype)
        return probs @ values

    def _prefill(self, q, k, v, k_cache, v_cache, chunk: PrefillChunk):
        n = q.shape[0]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if chunk.context_len == 0:
            kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            total = chunk.context_len + n
            kh = self._gather_keys(k_cache, chunk.block_ids)[:, :total].unsqueeze(0)
            vh = self._gather(v_cache, chunk.block_ids)[:, :total].unsqueeze(0)
            rows = torch.arange(n, device=q.device).unsqueeze(1) + chunk.context_len
            mask = torch.arange(total, device=q.device).unsqueeze(0) <= rows
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1).reshape(n, self.num_heads * self.head_dim)


# Where the CPU has AMX: a prompt chunk with no context of at least this many tokens runs in torch's flash attention
# (SDPA) rather than as rows of the native kernel: 8.6 against 17.1 ms for 30 layers at 256 tokens on 2 threads of a
# Xeon with AMX, 96 against 253 at 1,024; at 64 tokens 2.0 against 1.5 (README).
SDPA_MIN_TOKENS = 128
# ... where the native kernel's query tiles run on AMX too (engine/kernels/paged_attention_cpu.cpp), from this many:
# a lone prompt's prefill step on 2 threads of that Xeon 66-70 against SDPA's 71-74 ms at 256 tokens, 130-133 against
# 138-142 at 512 (before the softmax's rescale was vectorised, which took 20-28% off the kernel's attention), then
# 265-297 against 270-278 at 1,024, 665-681 against 611-763 at 2,048 (README).
SDPA_MIN_TOKENS_AMX_TILES = 1024


class CpuAttention(TorchAttention):
    """TorchAttention with decodes in a native kernel that reads K/V in place through the block table.

    In bf16, with blocks of a multiple of 16 tokens, keys are packed as [blocks, kv_heads, head_dim / 2,
    block_size, 2] so the kernel scores 16 tokens per AVX512-BF16 instruction (engine/kernels/paged_attention_cpu.cpp).
    Without AVX-512 but with AVX2, bf16 keys stay in the plain layout for the kernel's AVX2 path.
    """

    name = "cpu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, block_size)
        from engine.kernels import packed_keys_supported
        self.packed_keys = dtype == torch.bfloat16 and packed_keys_supported(block_size, head_dim,
                                                                             num_heads // num_kv_heads)
        from engine.kernels import plain_token_rows_supported
        # Every new token a row of the native kernel: with packed keys, or in bf16 where the CPU has the AVX2 kernel
        # (prompt chunks there 2-4x faster than SDPA, whose bf16 matmuls such CPUs run at ~16 GFLOP/s).
        self.uses_token_rows = self.packed_keys or (dtype == torch.bfloat16 and plain_token_rows_supported(head_dim))
        from engine.kernels import cpu_has_amx
        self.sdpa_prefill = self.uses_token_rows and cpu_has_amx()  # context-free prompt chunks by SDPA (forward)
        from engine.kernels import native_attention_amx
        self.sdpa_min_tokens = SDPA_MIN_TOKENS_AMX_TILES if self.uses_token_rows and native_attention_amx() \
            else SDPA_MIN_TOKENS
        self.query_tiles = True  # EngineConfig.attention_query_tiles: prompt rows in the kernel's query tiles

    def key_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.packed_keys:
            return (num_blocks, self.num_kv_heads, self.head_dim // 2, self.block_size, 2)
        return self.kv_cache_shape(num_blocks)

    def _gather_keys(self, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        if not self.packed_keys:
            return self._gather(cache, block_ids)
        lead = block_ids.shape[:-1]
        g = cache.index_select(0, block_ids.reshape(-1))  # [n, KVH, D/2, BS, 2]
        g = g.view(*lead, block_ids.shape[-1], self.num_kv_heads, self.head_dim // 2, self.block_size, 2)
        g = g.permute(*range(len(lead)), len(lead) + 1, len(lead), len(lead) + 3, len(lead) + 2, len(lead) + 4)
        return g.reshape(*lead, self.num_kv_heads, -1, self.head_dim)

    def forward(self, q, k, v, k_cache, v_cache, meta):
        from engine import kernels

        kernels.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        if self.uses_token_rows and meta.token_block_tables is not None:
            # Every new token, decode or prefill, is one row of the decode kernel: its request's blocks, causal up
            # to its own position (its K/V were just written). Faster than SDPA on prefill chunks on Zen 4 (~2.5x at
            # 256 tokens), and one parallel call for the whole step. Where the CPU has AMX, torch's flash attention
            # multiplies with its tiles: a chunk of sdpa_min_tokens or more with no context runs there instead.
            seq_lens = meta.token_positions + 1
            start = 0
            for chunk in (meta.prefills if self.sdpa_prefill else []):
                if chunk.context_len or chunk.query_len < self.sdpa_min_tokens:
                    continue
                s, n = chunk.query_start, chunk.query_len
                if s > start:
                    kernels.paged_decode_attention(out[start:s], q[start:s], k_cache, v_cache,
                                                   meta.token_block_tables[start:s], seq_lens[start:s], self.scale,
                                                   self.query_tiles)
                out[s:s + n] = self._prefill(q[s:s + n], k[s:s + n], v[s:s + n], k_cache, v_cache, chunk)
                start = s + n
            if start < q.shape[0]:
                kernels.paged_decode_attention(out[start:], q[start:], k_cache, v_cache,
                                               meta.token_block_tables[start:], seq_lens[start:], self.scale,
                                               self.query_tiles)
            return out
        nd = meta.num_decodes
        if nd:
            kernels.paged_decode_attention(out[:nd], q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                           meta.decode_seq_lens, self.scale)
        for chunk in meta.prefills:
            s, n = chunk.query_start, chunk.query_len
            out[s:s + n] = self._prefill(q[s:s + n], k[s:s + n], v[s:s + n], k_cache, v_cache, chunk)
        return out


class TritonAttention(AttentionBackend):
    """Paged Triton kernels (engine/triton_attention.py) reading K/V in place through the block tables.

    The cache is ``[blocks, block_size, kv_heads, head_dim]``. Decodes take the split-context kernel, prefill
    chunks (with or without context) the varlen kernel; both read the whole batch's block tables, sequence
    lengths and query starts.
    """

    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, num_heads, num_kv_heads, head_dim, block_size, num_sms: int = 1):
        super().__init__(num_heads, num_kv_heads, head_dim, block_size)
        from engine import triton_attention
        self._kernels = triton_attention
        self.num_sms = num_sms

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def forward(self, q, k, v, k_cache, v_cache, meta):
        ops = self._kernels
        ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        n = q.shape[0]
        out = torch.empty(n, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            splits = ops.decode_splits(nd, self.num_kv_heads, meta.max_seq_len, self.num_sms)
            ops.paged_decode(out[:nd], q[:nd], k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale,
                             splits)
        num_prefills = meta.seq_lens.shape[0] - nd
        if num_prefills:
            ops.paged_prefill(out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, nd,
                              num_prefills, meta.max_query_len, self.scale)
        return out.view(n, self.num_heads * self.head_dim)


class FlashAttention(AttentionBackend):
    """flash-attn's varlen kernel reading the paged cache through block tables (CUDA only)."""

    name = "flash-attn"

    def __init__(self, num_heads, num_kv_heads, head_dim, block_size):
        super().__init__(num_heads, num_kv_heads, head_dim, block_size)
        from flash_attn import flash_attn_varlen_func  # optional dependency: the `gpu` extra
        self._varlen = flash_attn_varlen_func

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def forward(self, q, k, v, k_cache, v_cache, meta):
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        cu_k = F.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        o = self._varlen(q, k_cache, v_cache, cu_seqlens_q=meta.query_start_loc, cu_seqlens_k=cu_k,
                         max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_seq_len,
                         softmax_scale=self.scale, causal=True, block_table=meta.block_tables)
        return o.reshape(q.shape[0], self.num_heads * self.head_dim)


BACKENDS = ("auto", "torch", "cpu", "triton", "flash-attn")
FLASH_ATTN_BLOCK = 256  # flash-attn's paged KV reads whole 256-token pages


def resolve_backend_name(name: str, device: torch.device) -> str:
    """What `auto` means here: `cpu` on CPU when the native kernels build, `triton` on CUDA, `torch` otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; use one of {', '.join(BACKENDS)}")
    if name != "auto":
        return name
    if device.type == "cpu":
        from engine.kernels import cpu_kernels_available
        return "cpu" if cpu_kernels_available() else "torch"
    if device.type == "cuda":
        if triton_available():
            return "triton"
        log.warning("Triton is not importable; using the torch attention backend on CUDA")
    return "torch"


def effective_block_size(name: str, block_size: int) -> int:
    """The KV block size a backend runs with: flash-attn needs a multiple of 256, every other one takes any."""
    if name == "flash-attn" and block_size % FLASH_ATTN_BLOCK:
        return -(-block_size // FLASH_ATTN_BLOCK) * FLASH_ATTN_BLOCK
    return block_size


def triton_available() -> bool:
    try:
        import triton  # noqa: F401  (CUDA builds of torch bring it; on CPU it comes with the dev extra)
        return True
    except ImportError:
        return False


def select_backend(name: str, device: torch.device, num_heads: int, num_kv_heads: int,
                   head_dim: int, block_size: int, dtype: torch.dtype = torch.float32) -> AttentionBackend:
    name = resolve_backend_name(name, device)
    if name == "torch":
        return TorchAttention(num_heads, num_kv_heads, head_dim, block_size)
    if name == "cpu":
        from engine.kernels import cpu_kernels_available
        if device.type != "cpu" or not cpu_kernels_available():
            raise ValueError("the cpu attention backend needs a CPU device and a working C++ compiler")
        return CpuAttention(num_heads, num_kv_heads, head_dim, block_size, dtype)
    if name == "triton":
        if not triton_available():
            raise ValueError("the triton attention backend needs Triton (CUDA builds of torch include it)")
        if device.type == "cuda":
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        elif device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
            num_sms = 1  # Triton's interpreter: the kernels run on CPU tensors, for tests
        else:
            raise ValueError("the triton attention backend needs a CUDA device (or TRITON_INTERPRET=1 on CPU)")
        return TritonAttention(num_heads, num_kv_heads, head_dim, block_size, num_sms)
    if device.type != "cuda":
        raise ValueError("the flash-attn backend needs a CUDA device")
    if block_size % FLASH_ATTN_BLOCK:
        raise ValueError(f"flash-attn's paged KV needs block_size a multiple of {FLASH_ATTN_BLOCK}, got {block_size}")
    return FlashAttention(num_heads, num_kv_heads, head_dim, block_size)
