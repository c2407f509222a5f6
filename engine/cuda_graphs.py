"""CUDA graphs for decode steps: one graph per batch bucket, replayed over static input buffers.

A decode step of a small model launches hundreds of kernels for a few microseconds of work each; replaying a
captured graph launches them all at once. Graphs are captured for buckets of 1, 2, 4, 8, then every 8 up to
`max_num_seqs` (the largest first, so the smaller ones reuse its memory: all share one pool). A step of n decodes
copies its inputs into the first n rows of the static buffers, pads the rest up to the bucket (slot -1: nothing is
stored; sequence length 0: nothing is read) and replays that bucket's graph. Steps with prefill tokens, and
batches past the largest bucket, run eagerly.
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata

log = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 8


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8, and max_num_seqs itself as the last bucket so that every decode batch fits one."""
    sizes = [s for s in SMALL_BUCKETS if s < max_num_seqs]
    sizes += range(SMALL_BUCKETS[-1] + BUCKET_STEP, max_num_seqs, BUCKET_STEP)
    return sizes + [max_num_seqs]


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding num_seqs rows, or None past the largest."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclass
class DecodeBuffers:
    """The static inputs every captured graph reads: row i is the i-th decode of the step."""

    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor  # [max_bs] int64
    slot_mapping: torch.Tensor  # [max_bs] int64; -1 on padded rows
    block_tables: torch.Tensor  # [max_bs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [max_bs] int32; 0 on padded rows
    query_start_loc: torch.Tensor  # [max_bs + 1] int32: one query token a row

    @classmethod
    def allocate(cls, max_batch: int, max_blocks_per_seq: int, device: torch.device) -> "DecodeBuffers":
        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(input_ids=zeros(max_batch), positions=zeros(max_batch),
                   slot_mapping=torch.full((max_batch,), -1, dtype=torch.int64, device=device),
                   block_tables=zeros(max_batch, max_blocks_per_seq, dtype=torch.int32),
                   seq_lens=zeros(max_batch, dtype=torch.int32),
                   query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32, device=device))

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, bucket: int) -> None:
        """Copies a step of n decodes into rows [0, n) and pads rows [n, bucket)."""
        n = input_ids.shape[0]
        width = meta.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"a block table of {width} blocks exceeds the captured {self.block_tables.shape[1]}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.slot_mapping[n:bucket].fill_(-1)
        self.seq_lens[n:bucket].zero_()

    def metadata(self, bucket: int, max_seq_len: int) -> AttentionMetadata:
        """The attention metadata of a bucket: views of the static buffers, shapes fixed by the bucket alone."""
        tables, lens = self.block_tables[:bucket], self.seq_lens[:bucket]
        return AttentionMetadata(slot_mapping=self.slot_mapping[:bucket], num_decodes=bucket,
                                 decode_block_tables=tables, decode_seq_lens=lens, seq_lens=lens,
                                 query_start_loc=self.query_start_loc[:bucket + 1], block_tables=tables,
                                 max_query_len=1, max_seq_len=max_seq_len)


class CudaGraphRunner:
    """Captures the model's decode forward per bucket; `forward` replays the bucket that holds the step."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, max_num_seqs: int, max_model_len: int,
                 block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], -(-max_model_len // block_size), device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.enabled = True  # benchmarks switch it off to time the same engine eagerly

    def run_padded(self, bucket: int) -> torch.Tensor:
        """The model on the static buffers' first `bucket` rows: what each graph captures."""
        b = self.buffers
        return self.model(b.input_ids[:bucket], b.positions[:bucket], self.kv_caches,
                          b.metadata(bucket, self.max_model_len))

    @torch.inference_mode()
    def capture(self) -> bool:
        """Captures every bucket; on any failure logs why, drops the graphs and leaves decode steps eager."""
        start = time.perf_counter()
        pool = None
        try:
            for size in reversed(self.sizes):
                self.run_padded(size)  # compiles the Triton kernels and settles the allocator outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self.run_padded(size)
                pool = graph.pool() if pool is None else pool
                self.graphs[size] = graph
            torch.cuda.synchronize()
        except Exception as exc:  # a capture that fails must cost speed, never the engine
            log.warning("CUDA graph capture failed, decode steps run eagerly: %r", exc)
            self.graphs.clear()
            self.outputs.clear()
            return False
        log.info("captured CUDA graphs for %d decode batch sizes (1 to %d) in %.1f s", len(self.sizes),
                 self.sizes[-1], time.perf_counter() - start)
        return True

    def can_run(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        return (self.enabled and not meta.prefills and meta.num_decodes == num_tokens
                and num_tokens <= self.sizes[-1])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states, rows [0, n): a view valid until the next forward."""
        n = input_ids.shape[0]
        bucket = bucket_for(n, self.sizes)
        self.buffers.load(input_ids, positions, meta, bucket)
        graph = self.graphs.get(bucket)
        if graph is None:  # not captured (CPU tests of the padding): the same padded forward, eagerly
            return self.run_padded(bucket)[:n]
        graph.replay()
        return self.outputs[bucket][:n]
