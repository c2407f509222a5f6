"""A step's inputs as a few host tensors, and what each rank's forward builds from them.

Rank 0 builds `StepInputs` from the scheduled batch; with tensor parallelism the same tensors are sent to the
other ranks (engine/tp_group.py), which then build the same positions, slots and attention metadata on their
own device: only token ids, context and query lengths, block tables and the rows whose logits are wanted travel.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention import AttentionBackend, AttentionMetadata, PrefillChunk
from engine.host_copies import to_device
from engine.request import Request
from engine.scheduler import ScheduledRequest

NUM_SIZES = 5  # the sizes that frame a packed step: tokens, requests, block-table width, logit rows, prompt rows
PROMPT_LOGPROBS_ROWS = 256  # prompt positions whose logits are held at once (256 x 49k vocab: 48 MiB in fp32)


def request_of_each_token(q_lens: torch.Tensor) -> torch.Tensor:
    """The index of the request each of a step's new tokens belongs to (q_lens[i] tokens of request i, in order).
    torch.repeat_interleave would do it, but on CPU it opens an OpenMP parallel region whatever its size, and that
    region's idle thread then spins on a core (libgomp's default spin, ~ms) that the kernels' own threads
    (engine/kernels/thread_pool.h) need for the step."""
    lens = q_lens.tolist()
    if all(n == 1 for n in lens):
        return torch.arange(len(lens))
    return torch.tensor([i for i, n in enumerate(lens) for _ in range(n)], dtype=torch.int64)


@dataclass
class StepInputs:
    """Host int64 tensors; requests in the order the forward takes them (decodes first)."""

    input_ids: torch.Tensor  # [tokens] the new tokens of every request, back to back
    context_lens: torch.Tensor  # [requests] tokens already in the cache (the first new token's position)
    query_lens: torch.Tensor  # [requests] new tokens per request
    block_tables: torch.Tensor  # [requests, width] padded with block 0
    logit_rows: torch.Tensor  # [rows] token indices whose logits the step computes
    prompt_rows: torch.Tensor  # [rows] token indices whose logits give prompt logprobs (in PROMPT_LOGPROBS_ROWS)
    # Rank 0 only (never sent): the prompt token each prompt row predicts, and (request, rows, logprobs) per request.
    prompt_targets: list[int] = field(default_factory=list)
    prompt_spans: list[tuple[Request, int, int]] = field(default_factory=list)

    @classmethod
    def build(cls, ordered: list[ScheduledRequest], every_token: bool = False) -> "StepInputs":
        """The step of `ordered` (decodes first); logits for the requests that sample, or for `every_token`."""
        ids: list[int] = []
        starts, lens, tables, rows = [], [], [], []
        prompt_rows: list[int] = []
        targets: list[int] = []
        spans: list[tuple[Request, int, int]] = []
        for s in ordered:
            r, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            want = r.sampling_params.prompt_logprobs
            if want is not None:
                # Position p's logits give prompt token p + 1's logprob; a chunk recomputed after a preemption
                # adds none twice.
                first = max(start + 1, len(r.prompt_logprobs) + 1)
                last = min(start + n, r.num_prompt_tokens - 1)
                if first <= last:
                    prompt_rows.extend(range(len(ids) + first - 1 - start, len(ids) + last - start))
                    targets.extend(r.prompt_token_ids[first:last + 1])
                    spans.append((r, last + 1 - first, want))
            ids.extend(r.all_token_ids[start:start + n])
            starts.append(start)
            lens.append(n)
            tables.append(r.block_ids)
            if every_token:
                rows.extend(range(len(ids) - n, len(ids)))
            elif s.samples:
                rows.append(len(ids) - 1)
        width = max(len(t) for t in tables)
        return cls(torch.tensor(ids, dtype=torch.int64), torch.tensor(starts, dtype=torch.int64),
                   torch.tensor(lens, dtype=torch.int64),
                   torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64),
                   torch.tensor(rows, dtype=torch.int64), torch.tensor(prompt_rows, dtype=torch.int64), targets, spans)

    @property
    def sizes(self) -> list[int]:
        return [self.input_ids.numel(), self.query_lens.numel(), self.block_tables.shape[1], self.logit_rows.numel(),
                self.prompt_rows.numel()]

    def pack(self) -> torch.Tensor:
        """One flat int64 tensor; `unpack` with `sizes` gives the step back."""
        return torch.cat([self.input_ids, self.context_lens, self.query_lens, self.block_tables.reshape(-1),
                          self.logit_rows, self.prompt_rows])

    @classmethod
    def unpack(cls, sizes: list[int], flat: torch.Tensor) -> "StepInputs":
        tokens, requests, width, rows, prompt_rows = sizes
        parts = flat.split([tokens, requests, requests, requests * width, rows, prompt_rows])
        return cls(parts[0], parts[1], parts[2], parts[3].view(requests, width), parts[4], parts[5])

    @staticmethod
    def packed_numel(sizes: list[int]) -> int:
        tokens, requests, width, rows, prompt_rows = sizes
        return tokens + requests * (2 + width) + rows + prompt_rows

    def device_inputs(self, backend: AttentionBackend, block_size: int, device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Token ids, positions and the attention metadata of this step, on `device`."""
        q_lens, starts, block_tables = self.query_lens, self.context_lens, self.block_tables
        seq_lens = starts + q_lens
        num_requests = q_lens.numel()
        num_decodes = int((q_lens == 1).sum())
        # Position of every new token: its request's start, plus its offset within the chunk.
        req_of_token = request_of_each_token(q_lens)
        query_start = torch.zeros(num_requests + 1, dtype=torch.int64)
        query_start[1:] = q_lens.cumsum(0)
        positions = (starts[req_of_token] + torch.arange(self.input_ids.numel())
                     - query_start[:-1][req_of_token])
        slot_mapping = block_tables[req_of_token, positions // block_size] * block_size + positions % block_size

        def blocks(n: int) -> int:
            return -(-n // block_size)

        meta = AttentionMetadata(slot_mapping=to_device(slot_mapping, device), num_decodes=num_decodes)
        if num_decodes:
            meta.decode_block_tables = to_device(block_tables[:num_decodes, :blocks(int(seq_lens[:num_decodes].max()))],
                                                 device)
            meta.decode_seq_lens = to_device(seq_lens[:num_decodes], device)
        for i in range(num_decodes, num_requests):
            ctx, n = int(starts[i]), int(q_lens[i])
            block_ids = to_device(block_tables[i, :blocks(ctx + n)], device) if ctx else None
            meta.prefills.append(PrefillChunk(int(query_start[i]), n, ctx, block_ids))
        if backend.name != "torch":
            meta.seq_lens = to_device(seq_lens, device, torch.int32)
            meta.query_start_loc = to_device(query_start, device, torch.int32)
            meta.block_tables = to_device(block_tables, device, torch.int32)
            meta.max_query_len, meta.max_seq_len = int(q_lens.max()), int(seq_lens.max())
        if backend.uses_token_rows:
            meta.token_block_tables = to_device(block_tables.index_select(0, req_of_token), device)
            meta.token_positions = to_device(positions, device)
        return to_device(self.input_ids, device), to_device(positions, device), meta
