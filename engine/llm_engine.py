"""LLMEngine: add requests, call step(), read outputs. Synchronous, single-threaded, no Ray, no HTTP.

A step that raises fails its batch, not the engine: each of its requests finishes with a RequestFailure, their
blocks are freed (the blocks the step was filling leave the prefix cache) and the next step runs. Only an error
that leaves the engine's state unknown (engine.failures.leaves_state_unknown) propagates out of `step`.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator

import torch

from engine.attention import effective_block_size
from engine.backlog import MIN_FINISHED, Backlog, Job, OutputLengths, StepCostModel
from engine.config import EngineConfig, ModelArgs
from engine.failures import EngineFatalError, FailureKind, RequestFailure, leaves_state_unknown
from engine.idle_cpus import EngineBoard, IdleCpus
from engine.kv_cache_manager import KVCacheManager
from engine.loader import load_model_source, open_checkpoint, read_generation_eos
from engine.model_runner import ModelRunner
from engine.models.layers import linears_described
from engine.kernels import kernel_load
from engine.outputs import EngineOutput, EngineStartup, EngineStats, SchedulerStats
from engine.request import Request, RequestStatus, TokenLogprobs
from engine.request_limits import RequestLimits
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.structured_output import GrammarCompiler, GrammarState, check_grammar
from engine.tenancy import DEFAULT_TENANCY, FairShare, Tenancy
from engine.tp_group import RankFailure, TensorParallelGroup, create_store
from engine.tp_layout import check_shardable
from engine.tp_ranks import LocalRanks, RankLauncher, RankSpec, rank_threads

log = logging.getLogger(__name__)

# A step with at least this many prompt tokens may borrow idle CPUs up to EngineConfig.prefill_threads, any other
# step up to EngineConfig.decode_threads; each thread beyond num_threads needs this much of a CPU that other
# processes leave idle (engine.idle_cpus). At half a CPU, a borrowed thread's even share of the step's work ends no
# later than the whole would on one thread, even if all the other processes' load fell on its CPU.
PREFILL_BORROW_MIN_TOKENS = 64
BORROW_IDLE_SHARE = 0.5
PREFILL_DECAY = 0.98  # weight of the average prompt tokens per step on its past: about 50 steps


class LLMEngine:
    def __init__(self, config: EngineConfig,
                 source: tuple[ModelArgs, dict[str, torch.Tensor]] | None = None,
                 ranks: RankLauncher | None = None) -> None:
        """``source`` lets a caller that already read the checkpoint (ModelArgs, tensors) skip reading it again.
        With ``tensor_parallel_size`` > 1, ``ranks`` starts the other ranks (default: local processes)."""
        started = time.perf_counter()
        loaded_before = kernel_load() is not None  # this process loaded the kernels already: not this engine's cost
        block_size = effective_block_size(config.attention_backend, config.block_size)
        if block_size != config.block_size:
            log.info("the %s backend needs KV blocks of %d tokens: block_size %d becomes %d",
                     config.attention_backend, block_size, config.block_size, block_size)
            config = dataclasses.replace(config, block_size=block_size)
        self.config = config
        torch.set_num_threads(rank_threads(config))
        torch.manual_seed(config.seed)
        # Tensor parallelism reads the checkpoint lazily: each rank only its own slices.
        args, weights = source or (open_checkpoint(config.model) if config.tensor_parallel_size > 1
                                   else load_model_source(config.model))
        self.model_args = args
        self.max_model_len = config.model_len(args)
        self.eos_token_ids = tuple(dict.fromkeys(args.eos_token_ids + read_generation_eos(config.model)))
        # Structured output: the grammar's end is the model's first end-of-sequence token.
        self.grammars = GrammarCompiler(config.model, args.vocab_size, self.eos_token_ids[0]) \
            if self.eos_token_ids else None
        loaded = time.perf_counter()
        self.ranks: RankLauncher | None = None
        self.runner = self._start_runner(config, args, weights, ranks)
        self._step_threads = 0  # torch threads the last step ran on (SchedulerStats.num_threads)
        self._board = (EngineBoard() if (config.prefill_threads or config.decode_threads) and config.device == "cpu"
                       and config.tensor_parallel_size == 1 else None)
        self._idle_cpus = None
        if self._board is not None:
            self._board.publish(0)  # on the board from the start: a neighbour's first reading counts it
            self._idle_cpus = IdleCpus(board=self._board)
        built = time.perf_counter()
        del weights
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len,
                                   FairShare(config.fair_share_prompt_weight, config.fair_share_output_weight),
                                   config.max_tokens_with_decodes, config.ttft_objective_s)
        self.requests: dict[str, Request] = {}
        self.limits = RequestLimits(args.vocab_size, self.max_model_len, self.runner.num_blocks, config.block_size)
        self.step_history: deque[SchedulerStats] = deque(maxlen=config.step_history)
        self.step_costs = StepCostModel()
        self.output_lengths = OutputLengths()
        self.backlog = Backlog()  # the queues' slot turns, refreshed after every change: other threads read it
        self._prefill_per_step = 0.0  # prompt tokens per step lately (an average over recent steps)
        self._step_fault: tuple[Callable[[Request], bool], BaseException] | None = None
        self._num_steps = 0
        self._prefix_queries = self._prefix_hits = 0
        self._prompt_tokens = self._generation_tokens = self._finished = 0
        kernels = None if loaded_before else kernel_load()
        self.startup = EngineStartup(0.0 if source else loaded - started, built - loaded,
                                     kernels.seconds if kernels else 0.0, bool(kernels and kernels.built),
                                     time.perf_counter() - started)
        log.info("engine ready: %s, %s on %s, attention backend %s, CUDA graphs %s, %d torch threads, %d KV blocks "
                 "of %d tokens, max context %d tokens, linears %s, layers %s, tensor parallel %d", args.architecture,
                 config.dtype, config.device, self.runner.attention_backend, self.cuda_graphs,
                 torch.get_num_threads(), self.runner.num_blocks, config.block_size, self.max_model_len,
                 linears_described(self.runner.linear_packing, self.runner.native_max_rows),
                 "native" if getattr(self.runner.model, "native_layers", False) else "python",
                 config.tensor_parallel_size)

    def _start_runner(self, config: EngineConfig, args: ModelArgs, weights, ranks: RankLauncher | None
                      ) -> ModelRunner:
        """This process's runner; with tensor parallelism, rank 0 of a group whose other ranks start here."""
        size = config.tensor_parallel_size
        if size == 1:
            return ModelRunner(config, args, weights, self.max_model_len, self.grammars)
        check_shardable(args, size)
        self.ranks = ranks or LocalRanks()
        store, rendezvous = create_store(size)
        device = self.ranks.device(0, config)
        group = TensorParallelGroup(0, size, store, torch.device(device), config.collective_timeout_s,
                                config.shm_collectives)
        self.ranks.start([RankSpec(config, r, rendezvous, self.ranks.device(r, config)) for r in range(1, size)])
        try:
            runner = ModelRunner(config, args, weights, self.max_model_len, self.grammars, group, device,
                                 self.ranks.check)
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
        """Lets go of the node's shared weights and stops the other tensor-parallel ranks."""
        if self._board is not None:
            self._board.close()
        self.runner.release_weights()
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

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, n: int = 1) -> None:
        """Raises InvalidRequestError for a request this engine cannot run; touches no state."""
        self.limits.check(prompt_token_ids, params, n)
        if params.structured_output is not None:
            if self.grammars is None:
                raise InvalidRequestError("this model has no end-of-sequence token, so structured output cannot "
                                          "end; send the request without it", "response_format")
            check_grammar(params.structured_output)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, deadline: float | None = None,
                    validated: bool = False, tenancy: Tenancy = DEFAULT_TENANCY) -> None:
        """`deadline` (time.time()): past it, the request is dropped if it still waits. `validated`: the caller
        already ran `validate` on these very arguments (AsyncEngine does, before queueing). `tenancy`: its
        tenant, weight, priority and cache salt (engine.tenancy)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running", "request_id")
        if not validated:
            self.validate(prompt_token_ids, params)
        request = Request(request_id, prompt_token_ids, params, self.config.block_size, self.eos_token_ids,
                          arrival_time, record_events=self.config.record_request_events, deadline=deadline,
                          tenancy=tenancy)
        if params.structured_output is not None:
            request.grammar = GrammarState(self.grammars.submit(params.structured_output))
        self.requests[request_id] = request
        self.scheduler.add(request)
        self.backlog = self.backlog.plus([self.output_lengths.job_of(request)])

    def abort(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        self._finished += 1
        self._refresh_backlog()
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def settle(self, timeout_s: float | None = None) -> bool:
        """Waits for the work the engine does in the background after it starts (its memory moving to huge pages:
        engine.huge_pages), which slows its first seconds' steps; benchmarks call it before they time anything.
        False if it is still going after `timeout_s`."""
        job = self.runner.huge_pages
        return job is None or job.join(timeout_s)

    def step(self) -> list[EngineOutput]:
        """Schedule, run the batch, update the requests from what it sampled, hand out their outputs."""
        outputs = self._step()
        if self._board is not None and not self.scheduler.has_unfinished():
            self._board.publish(0)  # idle: its neighbours may borrow its CPUs
        return outputs

    def _step(self) -> list[EngineOutput]:
        start, t0 = time.time(), time.perf_counter()
        outputs = self._fail_broken_grammars()
        try:
            sched = self.scheduler.schedule()
        except Exception as exc:
            return outputs + self._fail_batch(self.scheduler.last_output, {}, exc, "scheduling")
        outputs += [self._finished_output(r) for r in sched.expired]
        if sched.is_empty:
            self._refresh_backlog()
            self._wait_for_grammars()
            return outputs
        schedule_s = time.perf_counter() - t0
        # KV is computed up to here for each request; a failed step leaves nothing valid past it.
        computed = {s.request.request_id: s.request.num_computed_tokens for s in sched.scheduled}
        decodes = [s.is_decode for s in sched.scheduled]  # read before the update moves the requests on
        prefill_tokens = sum(s.num_new_tokens for s, decode in zip(sched.scheduled, decodes) if not decode)
        try:
            for s in sched.scheduled:
                if s.request.grammar is not None:
                    s.request.grammar.start(s.request.output_token_ids)
            self._raise_injected_fault(sched)
            with self._threads_for(prefill_tokens):
                sampled = self.runner.execute(sched.scheduled)
            advanced = self.scheduler.update_from_output(sched, sampled)
            sampled_outputs = [self._sampled_output(r, token, logprobs) for r, token, logprobs in advanced]
        except Exception as exc:
            return outputs + self._fail_batch(sched, computed, exc, "running")
        self._record_step(sched, decodes, prefill_tokens, computed, start, time.perf_counter() - t0, schedule_s,
                          advanced)
        return outputs + sampled_outputs

    @contextlib.contextmanager
    def _threads_for(self, prefill_tokens: int) -> Iterator[None]:
        """A step with PREFILL_BORROW_MIN_TOKENS or more of prefill runs on `prefill_threads`, any other on
        `decode_threads`, while other processes leave this process's CPUs idle (engine.idle_cpus); otherwise, or
        where that is unset, on `num_threads`. The board hears the threads each step runs on."""
        wanted = self.config.prefill_threads if prefill_tokens >= PREFILL_BORROW_MIN_TOKENS \
            else self.config.decode_threads
        threads = torch.get_num_threads()
        self._step_threads = threads if self.config.device == "cpu" else 0
        extra = wanted - threads if wanted and self._idle_cpus is not None else 0
        if extra <= 0 or self._idle_cpus.idle() - threads < extra * BORROW_IDLE_SHARE:
            if self._board is not None:
                self._board.publish(threads)
            yield
            return
        self._board.publish(wanted)
        torch.set_num_threads(wanted)
        self._step_threads = wanted
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            self._board.publish(threads)

    def _sampled_output(self, request: Request, token: int, logprobs: TokenLogprobs | None) -> EngineOutput:
        if request.is_finished:
            del self.requests[request.request_id]
            self.output_lengths.observe(request.num_output_tokens)
        return self._output(request, [token], [logprobs] if logprobs else [])

    def _finished_output(self, request: Request) -> EngineOutput:
        """The last output of a request the engine ended before it ran (its deadline passed, its grammar broke)."""
        del self.requests[request.request_id]
        self._finished += 1
        return self._output(request, [], [])

    def _record_step(self, sched: SchedulerOutput, decodes: list[bool], prefill_tokens: int,
                     computed: dict[str, int], start: float, duration_s: float, schedule_s: float,
                     advanced: list[tuple[Request, int, TokenLogprobs | None]]) -> None:
        """The step's statistics: the engine's counters, the step cost model, the step ring. `computed`: each
        request's KV length before the step."""
        decode_tokens = sum(decodes)
        # The context the decodes attend to, and the prefill's attention work (query x key tokens, millions).
        context_tokens = sum(computed[s.request.request_id] + 1 for s, d in zip(sched.scheduled, decodes) if d)
        attention = sum(s.num_new_tokens * (computed[s.request.request_id] + s.num_new_tokens / 2)
                        for s, d in zip(sched.scheduled, decodes) if not d) / 1e6
        finished = sum(1 for s in sched.scheduled if s.request.is_finished)
        # A request's prompt counts once, when its first token is sampled.
        self._prompt_tokens += sum(r.num_prompt_tokens for r, _, _ in advanced if r.num_output_tokens == 1)
        self._generation_tokens += len(advanced)
        self._finished += finished
        self._num_steps += 1
        prefix = self.kv.stats.reset()
        self._prefix_queries += prefix.queries
        self._prefix_hits += prefix.hits
        self.step_costs.observe(prefill_tokens, decode_tokens, duration_s)
        self._prefill_per_step = PREFILL_DECAY * self._prefill_per_step + (1 - PREFILL_DECAY) * prefill_tokens
        self._refresh_backlog()
        self.step_history.append(SchedulerStats(
            step=self._num_steps, time=start, duration_s=duration_s,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_usage=self.kv.usage, num_prefill_tokens=prefill_tokens, num_decode_tokens=decode_tokens,
            num_prefill_requests=len(decodes) - decode_tokens, num_decode_requests=decode_tokens,
            num_preempted=len(sched.preempted), prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits, num_finished=finished + len(sched.expired), num_context_tokens=context_tokens,
            prefill_attention=attention, schedule_s=schedule_s,
            prepare_s=self.runner.times.prepare_s, forward_s=self.runner.times.forward_s,
            sample_s=self.runner.times.sample_s, num_threads=self._step_threads))

    def _fail_batch(self, sched: SchedulerOutput, computed: dict[str, int], exc: Exception,
                    stage: str) -> list[EngineOutput]:
        """Ends every request of a failed step with an error and frees its blocks; the engine goes on.

        Raises when the error leaves the engine's state unknown, or when freeing the batch fails."""
        batch = sched.batch()
        if leaves_state_unknown(exc):
            raise exc
        log.error("engine step failed while %s; failing its %d request(s): %s", stage, len(batch),
                  [r.request_id for r in batch], exc_info=exc)
        failure = RequestFailure(FailureKind.STEP_FAILED, "the engine failed the batch this request was in; the "
                                 "request itself may be fine", "engine_step_failed")
        if isinstance(exc, InvalidRequestError):  # raised on a request's own input, met only mid-step
            failure = RequestFailure(FailureKind.INVALID_REQUEST, str(exc), exc.code, exc.param)
        outputs = []
        try:
            for request in batch:
                # One that finished earlier in this very step lost its output with the step: it fails too.
                if not request.is_finished:
                    self.scheduler.finish(request, RequestStatus.FINISHED_ERROR,
                                          computed.get(request.request_id, request.num_computed_tokens))
                request.status, request.failure = RequestStatus.FINISHED_ERROR, failure
                self.requests.pop(request.request_id, None)
                self._finished += 1
                outputs.append(self._output(request, [], []))
            self.kv.stats.reset()
            self._refresh_backlog()
        except Exception as cleanup_error:
            raise EngineFatalError("freeing a failed step's requests failed; the KV pool cannot be trusted") \
                from cleanup_error
        return outputs

    def inject_step_fault(self, matches: Callable[[Request], bool], error: BaseException | None = None) -> None:
        """Test hook: the next step whose batch holds a request that `matches` raises `error` (a RuntimeError by
        default) after scheduling, where a failing forward pass or sampler would. It fires once."""
        self._step_fault = (matches, error or RuntimeError("injected step fault"))

    def _raise_injected_fault(self, sched: SchedulerOutput) -> None:
        fault = self._step_fault
        if fault is not None and any(fault[0](s.request) for s in sched.scheduled):
            self._step_fault = None
            raise fault[1]

    def _refresh_backlog(self) -> None:
        lengths = self.output_lengths
        self.backlog = Backlog.of((lengths.job_of(r) for r in self.scheduler.running),
                                  (lengths.job_of(r) for r in self.scheduler.waiting), self.config.max_num_seqs,
                                  self.runner.num_blocks * self.config.block_size)

    def predicted_wait_s(self, pending: Iterable[Job] = ()) -> float | None:
        """Seconds until a request queued now (after `pending` ones) could start; None until this engine has run
        MIN_STEPS steps and finished MIN_FINISHED requests. Safe to call from any thread."""
        estimate = self._estimate(pending, [])
        return None if estimate is None else estimate[0]

    def predicted_finish_s(self, jobs: list[Job], pending: Iterable[Job] = ()) -> tuple[float, float] | None:
        """(seconds until `jobs`, queued now after `pending` ones, would all finish; seconds they would take on an
        idle engine), or None while there is no estimate."""
        estimate = self._estimate(pending, jobs)
        return None if estimate is None else estimate[1:]

    def _estimate(self, pending: Iterable[Job], jobs: list[Job]) -> tuple[float, float, float] | None:
        if not self.step_costs.ready or self.output_lengths.count < MIN_FINISHED:
            return None
        queued = self.backlog.plus(pending)
        after, finish_step = queued.place(jobs)
        alone, alone_steps = Backlog.of([], [], self.config.max_num_seqs, self.runner.num_blocks *
                                        self.config.block_size).place(jobs)
        alone_s = alone_steps * self.step_costs.step_seconds(alone.batch, alone.prefill_tokens / max(alone_steps, 1.0))
        if queued.num_requests == 0:
            # Idle, nothing accepted: `jobs` run alone. The prompt tokens per step of a load that has passed do not
            # price the steps of a replica that holds nothing now.
            return 0.0, alone_s, alone_s
        step_s = self._step_s(after)
        return queued.start_step * step_s, finish_step * step_s, alone_s

    def _step_s(self, backlog: Backlog) -> float:
        """A coming step's seconds: the batch the queues fill, and the prompt tokens this engine has been
        prefilling per step lately, or the queue's own per step, if more."""
        prefill = max(self._prefill_per_step, backlog.prefill_tokens / max(backlog.drain_steps, 1.0))
        return self.step_costs.step_seconds(backlog.batch, prefill)

    def _output(self, request: Request, tokens: list[int], logprobs: list) -> EngineOutput:
        done = request.is_finished
        return EngineOutput(
            request_id=request.request_id, new_token_ids=tokens, finished=done,
            finish_reason=request.status.finish_reason, num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens, num_cached_tokens=max(request.num_cached_tokens, 0),
            num_preemptions=request.num_preemptions, logprobs=logprobs, timings=request.timings if done else None,
            failure=request.failure,
            prompt_logprobs=request.prompt_logprobs if request.num_output_tokens == 1 else [])

    def _fail_broken_grammars(self) -> list[EngineOutput]:
        """Ends waiting requests whose grammar failed to compile (the border's check lets few through)."""
        broken = [r for r in self.scheduler.waiting if r.grammar is not None and r.grammar.ready and r.grammar.error]
        outputs = []
        for request in broken:
            log.warning("request %s: %s", request.request_id, request.grammar.error)
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
            request.failure = RequestFailure(FailureKind.INVALID_REQUEST,
                                             f"the structured output could not be compiled: {request.grammar.error:.500}",
                                             "invalid_grammar", "response_format")
            outputs.append(self._finished_output(request))
        return outputs

    def _wait_for_grammars(self, timeout_s: float = 0.01) -> None:
        """Nothing could run: rather than spin, wait briefly for a grammar still compiling (if any)."""
        pending = [r.grammar.future for r in self.scheduler.waiting if r.grammar is not None and not r.grammar.ready]
        if pending:
            concurrent.futures.wait(pending, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_waiting_late=self.scheduler.waiting.num_late,
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
