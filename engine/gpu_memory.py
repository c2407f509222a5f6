"""Sizing the KV pool on a GPU from what is left after the weights and a profiled peak step, as vLLM does.

    pool = total × gpu_memory_utilization − peak torch memory of the heaviest step − memory outside torch

The heaviest step is `max_num_batched_tokens` prompt tokens spread over up to `max_num_seqs` requests that all
sample, run for real through `ModelRunner.execute` on a scratch KV cache just big enough for it. Memory outside
torch (the CUDA context, cuBLAS workspaces, Triton's modules) is what the driver reports used beyond torch's
reservation. CUDA graphs are captured later and live in the `1 − gpu_memory_utilization` margin.
"""
from __future__ import annotations

import logging

import torch

from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest

log = logging.getLogger(__name__)
GIB = 1 << 30


def kv_cache_budget(total_bytes: int, utilization: float, peak_torch_bytes: int, non_torch_bytes: int) -> int:
    """Bytes left for KV blocks; negative when the model and its peak step alone exceed the share."""
    return int(total_bytes * utilization) - peak_torch_bytes - max(0, non_torch_bytes)


def profile_step_requests(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
                          vocab_size: int) -> list[ScheduledRequest]:
    """The heaviest step the scheduler can build: the whole token budget as prompts of up to max_num_seqs
    requests, each sampling with top-k, top-p and logprobs (the sampler's largest temporaries)."""
    num_seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
    lengths = [min(max_model_len, max_num_batched_tokens // num_seqs + (i < max_num_batched_tokens % num_seqs))
               for i in range(num_seqs)]
    params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, top_k=50, logprobs=20)
    scheduled, next_block = [], 0
    for i, n in enumerate(lengths):
        request = Request(f"profile-{i}", [(i + t) % vocab_size for t in range(max(1, n))], params, block_size)
        blocks = -(-request.num_tokens // block_size)
        request.block_ids = list(range(next_block, next_block + blocks))
        next_block += blocks
        scheduled.append(ScheduledRequest(request, request.num_tokens))
    return scheduled


def profile_kv_cache_bytes(runner, max_model_len: int) -> int:
    """Runs the heaviest step on a scratch cache and returns the bytes the KV pool may take."""
    config, device = runner.config, runner.device
    scheduled = profile_step_requests(config.max_num_batched_tokens, config.max_num_seqs, max_model_len,
                                      runner.block_size, runner.args.vocab_size)
    scratch_blocks = sum(len(s.request.block_ids) for s in scheduled)
    k_shape, v_shape = runner.backend.key_cache_shape(scratch_blocks), runner.backend.kv_cache_shape(scratch_blocks)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    runner.kv_caches = [(torch.zeros(k_shape, dtype=runner.dtype, device=device),
                         torch.zeros(v_shape, dtype=runner.dtype, device=device))
                        for _ in range(runner.args.num_layers)]
    try:
        runner.execute(scheduled)
        torch.cuda.synchronize(device)
    finally:
        runner.kv_caches = []
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    budget = kv_cache_budget(total, config.gpu_memory_utilization, peak, non_torch)
    log.info("GPU memory: %.1f GiB total, %.0f%% for this engine; weights + peak step %.2f GiB (%d tokens, %d "
             "requests), outside torch %.2f GiB; KV pool %.2f GiB", total / GIB, 100 * config.gpu_memory_utilization,
             peak / GIB, sum(s.num_new_tokens for s in scheduled), len(scheduled), non_torch / GIB, budget / GIB)
    if budget < runner.kv_bytes_per_block:
        raise ValueError(
            f"no GPU memory left for the KV cache: {total / GIB:.1f} GiB × gpu_memory_utilization "
            f"{config.gpu_memory_utilization} leaves {budget / GIB:.2f} GiB after the weights and a peak step of "
            f"{config.max_num_batched_tokens} tokens; raise gpu_memory_utilization, lower max_num_batched_tokens "
            f"or max_num_seqs, or use a smaller model")
    return budget
