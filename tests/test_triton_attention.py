"""The Triton attention backend agrees with the torch backend: paged layouts with shuffled blocks, ragged contexts,
GQA groups, decode splits, chunked prefill with context, padded slots; and an engine on it samples the same tokens.

Without a GPU the kernels run in Triton's interpreter on CPU float32 tensors; on a CUDA machine (`make gpu-check`)
the same tests run compiled on the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # on CPU, conftest turns the interpreter on
pytest.importorskip("triton", reason="Triton is not installed (make install brings it with the dev extra)")

from engine.attention import AttentionMetadata, PrefillChunk, select_backend  # noqa: E402
from engine import triton_attention  # noqa: E402

KV_HEADS = 2
TOL = 2e-5 if DEVICE.type == "cpu" else 1e-4  # fp32 either way; on a GPU exp2 and reduction order differ more


@dataclass
class Batch:
    """One step's new tokens over a paged cache already holding each sequence's context."""

    q: torch.Tensor  # [N, H, D]
    k: torch.Tensor  # [N, KVH, D]
    v: torch.Tensor
    context_k: list[torch.Tensor]  # per sequence, [context, KVH, D]
    context_v: list[torch.Tensor]
    tables: list[list[int]]
    contexts: list[int]
    query_lens: list[int]
    num_decodes: int


def make_batch(seed: int, group: int, head_dim: int, block_size: int, decode_contexts: list[int],
               prefills: list[tuple[int, int]], num_blocks: int = 64) -> Batch:
    """Decodes (context before the new token) then prefill chunks (context, chunk length); blocks shuffled."""
    gen = torch.Generator().manual_seed(seed)
    contexts = decode_contexts + [c for c, _ in prefills]
    query_lens = [1] * len(decode_contexts) + [n for _, n in prefills]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for ctx, n in zip(contexts, query_lens):
        need = -(-(ctx + n) // block_size)
        tables.append([free.pop() for _ in range(need)])
    total = sum(query_lens)
    heads = KV_HEADS * group

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    return Batch(q=randn(total, heads, head_dim), k=randn(total, KV_HEADS, head_dim),
                 v=randn(total, KV_HEADS, head_dim),
                 context_k=[randn(c, KV_HEADS, head_dim) for c in contexts],
                 context_v=[randn(c, KV_HEADS, head_dim) for c in contexts],
                 tables=tables, contexts=contexts, query_lens=query_lens, num_decodes=len(decode_contexts))


def fill_context(backend, batch: Batch, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's context written straight into the backend's own cache layout."""
    shape = backend.kv_cache_shape(num_blocks)
    k_cache, v_cache = torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE)
    bs = backend.block_size
    for table, ck, cv in zip(batch.tables, batch.context_k, batch.context_v):
        for p in range(ck.shape[0]):
            block, off = table[p // bs], p % bs
            if backend.name == "torch":
                k_cache[block, :, off], v_cache[block, :, off] = ck[p], cv[p]
            else:
                k_cache[block, off], v_cache[block, off] = ck[p], cv[p]
    return k_cache, v_cache


def metadata(batch: Batch, block_size: int, pad_rows: int = 0) -> AttentionMetadata:
    """What the model runner builds for this step, for every backend (plus `pad_rows` padded decode rows)."""
    slots, starts = [], [0]
    for table, ctx, n in zip(batch.tables, batch.contexts, batch.query_lens):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + n)]
        starts.append(starts[-1] + n)
    seq_lens = [c + n for c, n in zip(batch.contexts, batch.query_lens)]
    width = max(len(t) for t in batch.tables)
    tables = [t + [0] * (width - len(t)) for t in batch.tables]
    nd = batch.num_decodes
    if pad_rows:  # a CUDA-graph bucket: padded decodes have slot -1 and no context
        slots = slots[:nd] + [-1] * pad_rows + slots[nd:]
        seq_lens = seq_lens[:nd] + [0] * pad_rows + seq_lens[nd:]
        tables = tables[:nd] + [[0] * width] * pad_rows + tables[nd:]
        starts = list(range(nd + pad_rows + 1)) + [s + pad_rows for s in starts[nd + 1:]]
        nd += pad_rows
    table_t = torch.tensor(tables, device=DEVICE)
    meta = AttentionMetadata(torch.tensor(slots, device=DEVICE), nd)
    if nd:
        meta.decode_block_tables = table_t[:nd]
        meta.decode_seq_lens = torch.tensor(seq_lens[:nd], device=DEVICE)
    for i in range(nd, len(seq_lens)):
        ctx, n = seq_lens[i] - (starts[i + 1] - starts[i]), starts[i + 1] - starts[i]
        meta.prefills.append(PrefillChunk(starts[i], n, ctx, table_t[i] if ctx else None))
    meta.seq_lens = torch.tensor(seq_lens, device=DEVICE, dtype=torch.int32)
    meta.query_start_loc = torch.tensor(starts, device=DEVICE, dtype=torch.int32)
    meta.block_tables = table_t.to(torch.int32)
    meta.max_query_len, meta.max_seq_len = max(batch.query_lens), max(seq_lens)
    return meta


def run(backend_name: str, batch: Batch, head_dim: int, block_size: int, num_blocks: int = 64):
    heads = batch.q.shape[1]
    backend = select_backend(backend_name, DEVICE, heads, KV_HEADS, head_dim, block_size)
    k_cache, v_cache = fill_context(backend, batch, num_blocks)
    meta = metadata(batch, block_size)
    out = backend.forward(batch.q.to(DEVICE), batch.k.to(DEVICE), batch.v.to(DEVICE), k_cache, v_cache, meta)
    return out, k_cache, v_cache


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_mixed_decodes_and_chunked_prefills_match_the_torch_backend(group, head_dim, block_size):
    # Ragged contexts (a partial last block, exact block multiples, a long one), a prefill without context and
    # chunks with context that start mid-block.
    batch = make_batch(seed=group * 1000 + head_dim + block_size, group=group, head_dim=head_dim,
                       block_size=block_size, decode_contexts=[0, 5, block_size, 3 * block_size + 7, 150],
                       prefills=[(0, 23), (block_size + 3, 19), (2 * block_size, 70)])
    expected, k_torch, _ = run("torch", batch, head_dim, block_size)
    got, k_triton, _ = run("triton", batch, head_dim, block_size)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=TOL)
    # The store wrote every new token where the torch backend did.
    torch.testing.assert_close(k_triton, k_torch.transpose(1, 2))


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_context_splits_give_the_unsplit_result(num_splits):
    # Splits of 64-token tiles over contexts from 1 token to many tiles; more splits than tiles leaves some empty.
    batch = make_batch(seed=7, group=4, head_dim=64, block_size=16, decode_contexts=[0, 40, 200, 517], prefills=[])
    expected, _, _ = run("torch", batch, 64, 16)
    backend = select_backend("triton", DEVICE, 8, KV_HEADS, 64, 16)
    k_cache, v_cache = fill_context(backend, batch, 64)
    meta = metadata(batch, 16)
    triton_attention.store_kv(batch.k.to(DEVICE), batch.v.to(DEVICE), k_cache, v_cache, meta.slot_mapping)
    out = torch.empty(4, 8, 64, device=DEVICE)
    triton_attention.paged_decode(out, batch.q.to(DEVICE), k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                  backend.scale, num_splits)
    torch.testing.assert_close(out.view(4, -1), expected, atol=TOL, rtol=TOL)


def test_padded_decode_rows_store_nothing_and_leave_real_rows_unchanged():
    batch = make_batch(seed=3, group=3, head_dim=64, block_size=16, decode_contexts=[9, 33], prefills=[(4, 12)])
    backend = select_backend("triton", DEVICE, 6, KV_HEADS, 64, 16)
    expected, k_expected, v_expected = run("triton", batch, 64, 16)
    k_cache, v_cache = fill_context(backend, batch, 64)
    pad = 3
    meta = metadata(batch, 16, pad_rows=pad)

    def padded(x):
        return torch.cat([x[:2], torch.full((pad, *x.shape[1:]), 7.0), x[2:]]).to(DEVICE)

    out = backend.forward(padded(batch.q), padded(batch.k), padded(batch.v), k_cache, v_cache, meta)
    torch.testing.assert_close(torch.cat([out[:2], out[2 + pad:]]), expected, atol=TOL, rtol=TOL)
    assert torch.equal(out[2:2 + pad], torch.zeros_like(out[2:2 + pad])), "a padded row attends to nothing"
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected), "a padded row wrote to the cache"


def test_engine_on_the_triton_backend_samples_the_torch_backends_greedy_tokens(tmp_path):
    from engine import EngineConfig, LLMEngine, SamplingParams
    from tests.tiny_models import write_tiny_model

    # head_dim 64, GQA group 2, a KV block of 16: prompts from one token to several blocks, chunked by a small
    # token budget so that steps mix decodes with prefill chunks that have context.
    write_tiny_model(tmp_path, "llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 17, 40, 75)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", device=DEVICE.type, num_kv_blocks=64,
                                        max_num_batched_tokens=48, attention_backend=backend))
        assert engine.runner.attention_backend == backend
        outputs[backend] = engine.generate(prompts, params)
        assert any(s.num_prefill_tokens and s.num_decode_tokens for s in engine.step_history)
    assert outputs["triton"] == outputs["torch"]
