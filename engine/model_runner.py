"""Rank 0's side of a step: the scheduled batch becomes the step's inputs (sent to the other ranks under tensor
parallelism), one forward pass over every rank, then sampling here."""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig, ModelArgs
from engine.model_shard import ModelShard, Weights
from engine.request import TokenLogprobs
from engine.sampler import Sampler, SamplingBatch, sampled_to_host
from engine.scheduler import ScheduledRequest
from engine.step_inputs import StepInputs
from engine.structured_output import GrammarCompiler
from engine.tp_group import TensorParallelGroup

log = logging.getLogger(__name__)


@dataclass
class StepTimes:
    """Seconds the last execute() spent in each part."""

    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0


class ModelRunner(ModelShard):
    def __init__(self, config: EngineConfig, args: ModelArgs, weights: Weights, max_model_len: int,
                 grammars: GrammarCompiler | None = None, group: TensorParallelGroup | None = None,
                 device: torch.device | str | None = None, check_peers=lambda: None) -> None:
        self.grammars = grammars
        self.sampler = Sampler()
        self.times = StepTimes()
        self._ranks_listening = False  # the other ranks run the same profiling step on their own during start-up
        super().__init__(config, args, weights, max_model_len, group, device, check_peers)
        self._ranks_listening = group is not None

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> dict[str, tuple[int, TokenLogprobs | None]]:
        """Runs the batch; returns the sampled token (and logprobs) of each request that samples."""
        t0 = time.perf_counter()
        # Rows of one query token first, the attention kernels' decode shape: a 1-token prefill chunk is one too, so
        # this is not ScheduledRequest.is_decode (a request past its prompt), which the step statistics count.
        ordered = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
        step = StepInputs.build(ordered)
        requests = [s.request for s in ordered if s.samples]
        # Built while the GPU runs nothing yet: its host-to-device copies then wait for no kernel.
        batch = SamplingBatch.from_requests(requests, self.args.vocab_size, self.device, self.grammars) \
            if requests else None
        with self._on_every_rank(step):
            t1 = time.perf_counter()
            hidden = self.forward(step)
            t2 = time.perf_counter()
            logits = self.logits(step, hidden)
            if step.prompt_spans:
                self._prompt_logprobs(step, hidden)
        self.times = StepTimes(t1 - t0, t2 - t1)
        if batch is None:
            return {}
        token_ids, logprobs = self.sampler.sample(logits, batch)
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        tokens, lps = sampled_to_host(token_ids, logprobs, rows, [requests[i].sampling_params.logprobs for i in rows])
        results: dict[str, tuple[int, TokenLogprobs | None]] = {r.request_id: (t, None) for r, t in zip(requests, tokens)}
        for i, lp in zip(rows, lps):
            results[requests[i].request_id] = (tokens[i], lp)
        self.times.sample_s = time.perf_counter() - t2
        return results

    @torch.inference_mode()
    def all_logits(self, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """fp32 logits of every new token of the step (decodes first), through every rank."""
        step = StepInputs.build(sorted(scheduled, key=lambda s: s.num_new_tokens != 1), every_token=True)
        with self._on_every_rank(step):
            return self.logits(step, self.forward(step))

    def _prompt_logprobs(self, step: StepInputs, hidden: torch.Tensor) -> None:
        """Appends to each asking request the logprobs of the prompt tokens this step's chunk predicts (position
        p's logits give token p + 1's logprob); a chunk recomputed after a preemption adds none twice."""
        targets = torch.tensor(step.prompt_targets, device=self.device)
        wants = [want for _, count, want in step.prompt_spans for _ in range(count)]
        entries: list[TokenLogprobs] = []
        done = 0
        for logits in self.prompt_logits(step, hidden):  # chunks bound the [rows, vocab] logits
            n = logits.shape[0]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            entries += sampled_to_host(targets[done:done + n], logprobs, list(range(n)), wants[done:done + n])[1]
            done += n
        for request, count, _ in step.prompt_spans:
            request.prompt_logprobs.extend(entries[:count])
            entries = entries[count:]

    @contextlib.contextmanager
    def _on_every_rank(self, step: StepInputs) -> Iterator[None]:
        """Sends the step to the other ranks around rank 0's own run of it (the heartbeat waits meanwhile)."""
        if not self._ranks_listening:
            yield
            return
        with self.group.lock:
            self.group.send_step(step)
            yield

    def _prepare(self, ordered: list[ScheduledRequest]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[tuple[ScheduledRequest, int]]]:
        """Token ids, positions and attention metadata of a batch on this device, and its sampling rows (for
        tests that drive the model directly)."""
        step = StepInputs.build(ordered)
        input_ids, positions, meta = step.device_inputs(self.backend, self.block_size, self.device)
        sampling = [s for s in ordered if s.samples]
        return input_ids, positions, meta, list(zip(sampling, step.logit_rows.tolist()))
