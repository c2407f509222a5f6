"""Decode steps padded to CUDA-graph buckets: which bucket a batch takes, what the padding holds, and that an
engine whose decodes run through the padded static buffers samples the same tokens. The replay itself needs a GPU
(`make gpu-check`); everything around it runs here, with the Triton kernels in Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata
from engine.cuda_graphs import CudaGraphRunner, DecodeBuffers, bucket_for, graph_batch_sizes
from engine.gpu_memory import kv_cache_budget, profile_step_requests


def test_buckets_are_1_2_4_8_then_every_8_up_to_max_num_seqs():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(100)[-3:] == [88, 96, 100]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(1) == [1]


def test_a_batch_takes_the_smallest_bucket_that_holds_it():
    sizes = graph_batch_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17, 63, 64)] == [1, 2, 4, 8, 8, 16, 16, 24, 64, 64]
    assert bucket_for(65, sizes) is None


def test_padding_fills_the_bucket_with_rows_that_store_and_read_nothing():
    buffers = DecodeBuffers.allocate(8, 6, torch.device("cpu"))
    buffers.seq_lens.fill_(99)  # left over from an earlier, larger step
    buffers.slot_mapping.fill_(5)
    meta = AttentionMetadata(slot_mapping=torch.tensor([17, 40, 3]), num_decodes=3,
                             seq_lens=torch.tensor([18, 41, 4], dtype=torch.int32),
                             block_tables=torch.tensor([[1, 0], [0, 2], [3, 0]], dtype=torch.int32))
    buffers.load(torch.tensor([11, 12, 13]), torch.tensor([17, 40, 3]), meta, bucket=4)
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [17, 40, 3, 0]
    assert buffers.slot_mapping[:4].tolist() == [17, 40, 3, -1]
    assert buffers.seq_lens[:4].tolist() == [18, 41, 4, 0]
    assert buffers.block_tables[:3, :2].tolist() == [[1, 0], [0, 2], [3, 0]]
    bucket_meta = buffers.metadata(4, max_seq_len=96)
    assert bucket_meta.num_decodes == 4 and bucket_meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert bucket_meta.block_tables.shape == (4, 6) and not bucket_meta.prefills
    with pytest.raises(ValueError, match="exceeds"):
        buffers.load(torch.tensor([1]), torch.tensor([0]), AttentionMetadata(
            torch.tensor([0]), 1, seq_lens=torch.tensor([1], dtype=torch.int32),
            block_tables=torch.zeros(1, 7, dtype=torch.int32)), bucket=1)


def test_decode_steps_through_the_padded_buffers_sample_the_eager_tokens(tmp_path):
    pytest.importorskip("triton", reason="Triton is not installed (make install brings it with the dev extra)")
    from engine import EngineConfig, LLMEngine, SamplingParams
    from tests.tiny_models import write_tiny_model

    write_tiny_model(tmp_path, "llama")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (3, 20, 9)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU, conftest turns Triton's interpreter on
    config = EngineConfig(model=str(tmp_path), dtype="float32", device=device, num_kv_blocks=32, max_num_seqs=6,
                          attention_backend="triton", enforce_eager=True)
    eager = LLMEngine(config).generate(prompts, params)
    padded = LLMEngine(config)
    runner = padded.runner
    # Uncaptured, the graph runner runs each decode step's padded forward eagerly (3 requests: bucket 4).
    runner.graph_runner = CudaGraphRunner(runner.model, runner.kv_caches, config.max_num_seqs,
                                          padded.max_model_len, config.block_size, runner.device)
    assert padded.generate(prompts, params) == eager
    assert int(runner.graph_runner.buffers.seq_lens.max()) > len(prompts[1]), "decodes went through the buffers"


def test_kv_budget_is_the_share_left_after_the_peak_step_and_memory_outside_torch():
    gib = 1 << 30
    assert kv_cache_budget(80 * gib, 0.9, 20 * gib, 1 * gib) == int(72 * gib) - 21 * gib
    assert kv_cache_budget(80 * gib, 0.9, 20 * gib, -gib) == int(72 * gib) - 20 * gib  # freed by others: not ours
    assert kv_cache_budget(16 * gib, 0.5, 10 * gib, 0) < 0


def test_the_profiled_step_fills_the_token_budget_with_sampling_requests():
    steps = profile_step_requests(max_num_batched_tokens=1000, max_num_seqs=64, max_model_len=4096, block_size=16,
                                  vocab_size=500)
    assert len(steps) == 64 and sum(s.num_new_tokens for s in steps) == 1000
    assert all(s.samples for s in steps)
    blocks = [b for s in steps for b in s.request.block_ids]
    assert len(blocks) == len(set(blocks)) == sum(-(-s.num_new_tokens // 16) for s in steps)
    capped = profile_step_requests(8192, 1, 2048, 16, 500)
    assert [s.num_new_tokens for s in capped] == [2048]
