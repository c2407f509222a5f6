"""LLMEngine: add requests, call step(), read outputs. Synchronous, single-threaded, no Ray, no HTTP."""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque

import torch

from engine.attention import effective_block_size
from engine.config import EngineConfig, ModelArgs
from engine.kv_cache_manager import KVCacheManager
from engine.loader import open_checkpoint, read_generation_eos
from engine.model_runner import ModelRunner
from engine.outputs import EngineOutput, EngineStats, SchedulerStats
from engine.request import EventKind, Request, RequestStatus
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.scheduler import Scheduler
from engine.tp_group import RankFailure, TensorParallelGroup, create_store
from engine.tp_layout import check_shardable
from engine.tp_ranks import LocalRanks, RankLauncher, RankSpec, rank_threads

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig,
                 source: tuple[ModelArgs, dict[str, torch.Tensor]] | None = None,
                 ranks: RankLauncher | None = None) -> None:
        """``source`` lets a caller that already read the checkpoint (ModelArgs, tensors) skip reading it again.
        With ``tensor_parallel_size`` > 1, ``ranks`` starts the other ranks (default: local processes)."""
        block_size = effective_block_size(config.attention_backend, config.block_size)
        if block_size != config.block_size:
            log.info("the %s backend needs KV blocks of %d tokens: block_size %d becomes %d",
                     config.attention_backend, block_size, config.block_size, block_size)
            config = dataclasses.replace(config, block_size=block_size)
        self.config = config
        torch.set_num_threads(rank_threads(config))
        torch.manual_seed(config.seed)
        args, weights = source or open_checkpoint(config.model)
        self.model_args = args
        self.max_model_len = config.model_len(args)
        self.ranks: RankLauncher | None = None
        self.runner = self._start_runner(config, args, weights, ranks)
        del weights
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len)
        self.eos_token_ids = tuple(dict.fromkeys(args.eos_token_ids + read_generation_eos(config.model)))
        self.requests: dict[str, Request] = {}
        self.step_history: deque[SchedulerStats] = deque(maxlen=config.step_history)
        self._num_steps = 0
        self._prefix_queries = self._prefix_hits = 0
        self._prompt_tokens = self._generation_tokens = self._finished = 0
        log.info("engine ready: %s, %s on %s, attention backend %s, CUDA graphs %s, %d torch threads, %d KV blocks "
                 "of %d tokens, max context %d tokens, linears %s, tensor parallel %d", args.architecture,
                 config.dtype, config.device, self.runner.attention_backend, self.cuda_graphs,
                 torch.get_num_threads(), self.runner.num_blocks, config.block_size, self.max_model_len,
                 self.runner.linear_packing or "F.linear", config.tensor_parallel_size)

    def _start_runner(self, config: EngineConfig, args: ModelArgs, weights, ranks: RankLauncher | None
                      ) -> ModelRunner:
        """This process's runner; with tensor parallelism, rank 0 of a group whose other ranks start here."""
        size = config.tensor_parallel_size
        if size == 1:
            return ModelRunner(config, args, weights, self.max_model_len)
        check_shardable(args, size)
        self.ranks = ranks or LocalRanks()
        store, rendezvous = create_store(size)
        device = self.ranks.device(0, config)
        group = TensorParallelGroup(0, size, store, torch.device(device), config.collective_timeout_s,
                                config.shm_collectives)
        self.ranks.start([RankSpec(config, r, rendezvous, self.ranks.device(r, config)) for r in range(1, size)])
        try:
            runner = ModelRunner(config, args, weights, self.max_model_len, group, device, self.ranks.check)
        except BaseException:
            self.ranks.stop(timeout_s=0)
            group.close()
            raise
        group.start_heartbeat(self.ranks.check)
        return runner

    def rank_failure(self) -> RankFailure | None:
        """Why a tensor-parallel rank can no longer serve (it died, failed or stopped answering); None if all can."""
        group = self.runner.group
        if group is None or group.failure is not None or self.ranks is None:
            return None if group is None else group.failure
        try:
            self.ranks.check()
        except RankFailure as exc:
            group.failure = exc
        return group.failure

    def close(self) -> None:
        """Stops the other tensor-parallel ranks (nothing to do on one device)."""
        group = self.runner.group
        if group is None or self.ranks is None:
            return
        failed = self.rank_failure() is not None
        group.stop_ranks()
        group.close()
        self.ranks.stop(timeout_s=0.0 if failed else 30.0)  # a failed rank may hang: end it at once
        self.ranks = None

    @property
    def cuda_graphs(self) -> bool:
        """Decode steps replay captured CUDA graphs."""
        return self.runner.graph_runner is not None

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidRequestError for a request this engine cannot run; touches no state."""
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty; send at least one token", "prompt")
        if any(not isinstance(t, int) or not 0 <= t < self.model_args.vocab_size for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.model_args.vocab_size})", "prompt")
        if n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {n} tokens "
                f"and max_tokens is {params.max_tokens} ({n + params.max_tokens} in all). "
                f"Shorten the prompt or lower max_tokens.", "max_tokens")
        blocks = self.kv.blocks_needed(n + params.max_tokens)
        if blocks > self.runner.num_blocks:
            raise InvalidRequestError(
                f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) needs {blocks} KV blocks and this "
                f"engine has {self.runner.num_blocks}; lower max_tokens or give the engine more KV memory",
                "max_tokens")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running", "request_id")
        self.validate(prompt_token_ids, params)
        request = Request(request_id, prompt_token_ids, params, self.config.block_size, self.eos_token_ids,
                          arrival_time, record_events=self.config.record_request_events)
        self.requests[request_id] = request
        self.scheduler.add(request)

    def abort(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        self._finished += 1
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineOutput]:
        start, t0 = time.time(), time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        schedule_s = time.perf_counter() - t0
        sampled = self.runner.execute(sched.scheduled)
        now = time.time()
        outputs: list[EngineOutput] = []
        prefill_tokens = decode_tokens = prefill_reqs = 0
        finished = 0
        for s in sched.scheduled:
            request = s.request
            if s.num_new_tokens == 1 and request.num_computed_tokens >= request.num_prompt_tokens:
                decode_tokens += 1
                request.timings.num_decode_steps += 1
            else:
                prefill_tokens += s.num_new_tokens
                prefill_reqs += 1
                request.timings.prefill_chunks.append((now, s.num_new_tokens))
                request.timings.record(EventKind.PREFILL_CHUNK, s.num_new_tokens)
            request.num_computed_tokens += s.num_new_tokens
            if request.request_id not in sampled:
                continue
            token, logprobs = sampled[request.request_id]
            request.append_output_token(token)
            if logprobs is not None:
                request.output_logprobs.append(logprobs)
            if request.timings.first_token is None:
                request.timings.first_token = now
                request.timings.record(EventKind.FIRST_TOKEN)
                self._prompt_tokens += request.num_prompt_tokens
            request.timings.last_token = now
            status = request.check_stop(self.max_model_len)
            if status is not None:
                self.scheduler.finish(request, status)
                del self.requests[request.request_id]
                finished += 1
            outputs.append(self._output(request, [token], [logprobs] if logprobs else []))
        self._generation_tokens += len(outputs)
        self._finished += finished
        self._num_steps += 1
        prefix = self.kv.stats.reset()
        self._prefix_queries += prefix.queries
        self._prefix_hits += prefix.hits
        self.step_history.append(SchedulerStats(
            step=self._num_steps, time=start, duration_s=time.perf_counter() - t0,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_usage=self.kv.usage, num_prefill_tokens=prefill_tokens, num_decode_tokens=decode_tokens,
            num_prefill_requests=prefill_reqs, num_decode_requests=decode_tokens,
            num_preempted=len(sched.preempted), prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits, num_finished=finished, schedule_s=schedule_s,
            prepare_s=self.runner.times.prepare_s, forward_s=self.runner.times.forward_s,
            sample_s=self.runner.times.sample_s))
        return outputs

    def _output(self, request: Request, tokens: list[int], logprobs: list) -> EngineOutput:
        done = request.is_finished
        return EngineOutput(
            request_id=request.request_id, new_token_ids=tokens, finished=done,
            finish_reason=request.status.finish_reason, num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens, num_cached_tokens=max(request.num_cached_tokens, 0),
            num_preemptions=request.num_preemptions, logprobs=logprobs, timings=request.timings if done else None)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_usage=self.kv.usage, num_kv_blocks=self.runner.num_blocks,
            num_free_kv_blocks=self.kv.pool.num_free_blocks, block_size=self.config.block_size,
            prefix_cache_queries=self._prefix_queries, prefix_cache_hits=self._prefix_hits,
            num_preemptions=self.scheduler.num_preemptions, num_steps=self._num_steps,
            num_prompt_tokens=self._prompt_tokens, num_generation_tokens=self._generation_tokens,
            num_finished_requests=self._finished)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 max_steps: int = 1_000_000) -> list[list[int]]:
        """Offline convenience: run prompts to completion and return their output token ids in order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{self._num_steps}-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        for _ in range(max_steps):
            if not self.has_unfinished():
                break
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
        return [results[rid] for rid in ids]
