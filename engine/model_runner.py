"""Turns a scheduled batch into one forward pass: flattened tokens, positions, slots, block tables; then samples."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, PrefillChunk, select_backend
from engine.config import EngineConfig, ModelArgs
from engine.cuda_graphs import CudaGraphRunner
from engine.host_copies import to_device
from engine.models.layers import select_linear_packing
from engine.models.llama import LlamaForCausalLM
from engine.request import TokenLogprobs
from engine.sampler import Sampler, SamplingBatch, sampled_to_host
from engine.scheduler import ScheduledRequest

log = logging.getLogger(__name__)


@dataclass
class StepTimes:
    """Seconds the last execute() spent in each part."""

    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0


class ModelRunner:
    def __init__(self, config: EngineConfig, args: ModelArgs, weights: dict[str, torch.Tensor],
                 max_model_len: int) -> None:
        self.config = config
        self.args = args
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        backend = select_backend(config.attention_backend, self.device, args.num_heads, args.num_kv_heads,
                                 args.head_dim, config.block_size, self.dtype)
        self.backend, self.attention_backend = backend, backend.name
        self.max_model_len = max_model_len
        with torch.device(self.device):  # parameters born on the GPU: no host copy of a large model
            model = LlamaForCausalLM(args, backend, self.dtype, max_model_len)
        model.load_weights(weights)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        if backend.name == "cpu":
            self.model.use_cpu_kernels()
        self.linear_packing = select_linear_packing(self.device, self.dtype, config.prepack_weights)
        if self.linear_packing:
            self.model.prepack_linears(self.linear_packing)
        self.sampler = Sampler()
        self.times = StepTimes()
        self.graph_runner: CudaGraphRunner | None = None
        self.num_blocks = self._num_blocks()
        k_shape, v_shape = backend.key_cache_shape(self.num_blocks), backend.kv_cache_shape(self.num_blocks)
        self.kv_caches = [(torch.zeros(k_shape, dtype=self.dtype, device=self.device),
                           torch.zeros(v_shape, dtype=self.dtype, device=self.device)) for _ in range(args.num_layers)]
        self.graph_runner = self._capture_graphs()

    @property
    def kv_bytes_per_block(self) -> int:
        a = self.args
        return 2 * a.num_layers * self.block_size * a.num_kv_heads * a.head_dim * self.dtype.itemsize

    def _num_blocks(self) -> int:
        if self.config.num_kv_blocks:
            return self.config.num_kv_blocks
        budget = self.config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            from engine.gpu_memory import profile_kv_cache_bytes
            budget = profile_kv_cache_bytes(self, self.max_model_len)
        return max(1, budget // self.kv_bytes_per_block)

    def _capture_graphs(self) -> CudaGraphRunner | None:
        """Decode-step CUDA graphs where they can run: CUDA, a backend whose kernels replay, not enforce_eager."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return None
        if not self.backend.supports_cuda_graphs:
            log.info("the %s attention backend does not replay in CUDA graphs; decode steps run eagerly",
                     self.backend.name)
            return None
        runner = CudaGraphRunner(self.model, self.kv_caches, self.config.max_num_seqs, self.max_model_len,
                                 self.block_size, self.device)
        return runner if runner.capture() else None

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> dict[str, tuple[int, TokenLogprobs | None]]:
        """Runs the batch; returns the sampled token (and logprobs) of each request that samples."""
        t0 = time.perf_counter()
        ordered = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)  # decodes first
        input_ids, positions, meta, sample_rows = self._prepare(ordered)
        requests = [s.request for s, _ in sample_rows]
        # Built while the GPU runs nothing yet: its host-to-device copies then wait for no kernel.
        batch = SamplingBatch.from_requests(requests, self.args.vocab_size, self.device) if requests else None
        t1 = time.perf_counter()
        graphs = self.graph_runner
        if graphs is not None and graphs.can_run(meta, input_ids.shape[0]):
            hidden = graphs.forward(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        t2 = time.perf_counter()
        self.times = StepTimes(t1 - t0, t2 - t1)
        if batch is None:
            return {}
        logits = self.model.compute_logits(hidden[to_device(torch.tensor([i for _, i in sample_rows]), self.device)])
        token_ids, logprobs = self.sampler.sample(logits, batch)
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        tokens, lps = sampled_to_host(token_ids, logprobs, rows, [requests[i].sampling_params.logprobs for i in rows])
        results: dict[str, tuple[int, TokenLogprobs | None]] = {r.request_id: (t, None) for r, t in zip(requests, tokens)}
        for i, lp in zip(rows, lps):
            results[requests[i].request_id] = (tokens[i], lp)
        self.times.sample_s = time.perf_counter() - t2
        return results

    def kv_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _prepare(self, ordered: list[ScheduledRequest]):
        bs, dev = self.block_size, self.device
        ids: list[int] = []
        pos_starts, q_lens, seq_lens, tables = [], [], [], []
        sample_rows = []
        for s in ordered:
            r, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            ids.extend(r.all_token_ids[start:start + n])
            pos_starts.append(start)
            q_lens.append(n)
            seq_lens.append(start + n)
            tables.append(r.block_ids)
            if s.samples:
                sample_rows.append((s, len(ids) - 1))
        num_decodes = sum(1 for n in q_lens if n == 1)
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int64)
        q_lens_t = torch.tensor(q_lens)
        seq_lens_t = torch.tensor(seq_lens)
        # Position of every new token: its request's start, plus its offset within the chunk.
        req_of_token = torch.repeat_interleave(torch.arange(len(ordered)), q_lens_t)
        query_start = torch.zeros(len(ordered) + 1, dtype=torch.int64)
        query_start[1:] = q_lens_t.cumsum(0)
        positions = torch.tensor(pos_starts)[req_of_token] + torch.arange(len(ids)) - query_start[:-1][req_of_token]
        slot_mapping = block_tables[req_of_token, positions // bs] * bs + positions % bs

        meta = AttentionMetadata(slot_mapping=to_device(slot_mapping, dev), num_decodes=num_decodes)
        if num_decodes:
            decode_blocks = self.kv_blocks_needed(int(seq_lens_t[:num_decodes].max()))
            meta.decode_block_tables = to_device(block_tables[:num_decodes, :decode_blocks], dev)
            meta.decode_seq_lens = to_device(seq_lens_t[:num_decodes], dev)
        for i in range(num_decodes, len(ordered)):
            ctx, n = pos_starts[i], q_lens[i]
            block_ids = to_device(block_tables[i, :self.kv_blocks_needed(ctx + n)], dev) if ctx else None
            meta.prefills.append(PrefillChunk(int(query_start[i]), n, ctx, block_ids))
        if self.attention_backend != "torch":
            meta.seq_lens = to_device(seq_lens_t, dev, torch.int32)
            meta.query_start_loc = to_device(query_start, dev, torch.int32)
            meta.block_tables = to_device(block_tables, dev, torch.int32)
            meta.max_query_len, meta.max_seq_len = max(q_lens), max(seq_lens)
        if self.backend.uses_token_rows:
            meta.token_block_tables = to_device(block_tables.index_select(0, req_of_token), dev)
            meta.token_positions = to_device(positions, dev)
        input_ids = to_device(torch.tensor(ids, dtype=torch.int64), dev)
        return input_ids, to_device(positions, dev), meta, sample_rows
