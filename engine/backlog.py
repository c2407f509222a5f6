"""An engine's backlog in seconds, from its own step history: what admission and routing compare with a deadline.

An engine runs at most `max_num_seqs` requests at once (fewer when the KV pool cannot hold that many), so its
queues are slots and turns: each running request holds a slot for the output tokens it is still expected to
produce (one step each), and each waiting one takes, in order, the first slot to come free. Expected output is a
request's `max_tokens`, capped by the running average of real output lengths unless it ignores EOS. Placing
every queued request gives, in steps, when a new request could start and when it would finish.

A step's time comes from a model fitted to this engine's own steps: `overhead + per_prefill_token × prefill
tokens + per_decode_token × decoding requests` (non-negative least squares, recent steps weighing most). A
decode costs more than a prompt token (a matrix-vector row and a pass over its whole context), and the overhead
is why a full batch drains more tokens per second. Future steps are priced at the batch the queues will fill and
at the prompt tokens per step this engine has been prefilling lately: requests that arrive after this one share
its steps too.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from engine.request import Request
from engine.sampling_params import SamplingParams

STEP_DECAY = 0.995  # each step weighs this much less than the one after it: a memory of a few hundred steps
MIN_STEPS = 16  # steps seen before the model says anything
MIN_FINISHED = 4  # finished requests seen before output lengths are estimated
LENGTH_DECAY = 0.95  # weight of the running average of output lengths on its past


@dataclass(frozen=True)
class Job:
    """What one request still asks of a slot: steps (one per output token still expected) and prompt tokens."""

    steps: float
    prefill_tokens: int
    context_tokens: float  # the KV it reaches: how many such requests the pool holds at once


class OutputLengths:
    """A running average of how many tokens finished requests really produced."""

    def __init__(self) -> None:
        self.mean: float | None = None
        self.count = 0

    def observe(self, num_output_tokens: int) -> None:
        self.count += 1
        self.mean = num_output_tokens if self.mean is None else (
            LENGTH_DECAY * self.mean + (1 - LENGTH_DECAY) * num_output_tokens)

    def expected(self, params: SamplingParams) -> float:
        """Output tokens a request will produce in all, best guess."""
        if params.ignore_eos or self.mean is None:
            return params.max_tokens
        return min(params.max_tokens, max(self.mean, params.min_tokens))

    def job_of(self, request: Request) -> Job:
        return self._job(request.num_tokens, request.num_computed_tokens, request.num_output_tokens,
                         request.sampling_params)

    def job_of_new(self, num_prompt_tokens: int, params: SamplingParams) -> Job:
        """A request not queued yet."""
        return self._job(num_prompt_tokens, 0, 0, params)

    def _job(self, num_tokens: int, num_computed: int, produced: int, params: SamplingParams) -> Job:
        left = min(max(self.expected(params) - produced, 1.0), params.max_tokens - produced)
        # Every token but the last is prefill (a preempted request recomputes its output too); the prefill step
        # yields the first output token, each later one costs a step.
        return Job(left, max(num_tokens - num_computed - 1, 0), num_tokens + left)


@dataclass(frozen=True)
class Backlog:
    """The queues as slot turns: `free_at` holds, per slot, the step at which it comes free once every queued
    request has been placed (a heap); a new request starts at the earliest."""

    free_at: tuple[float, ...] = (0.0,)
    num_requests: int = 0
    prefill_tokens: int = 0
    context_tokens: float = 0.0

    @classmethod
    def of(cls, running: Iterable[Job], waiting: Iterable[Job], max_num_seqs: int, kv_tokens: int) -> "Backlog":
        running, waiting = list(running), list(waiting)
        jobs = running + waiting
        context = sum(j.context_tokens for j in jobs)
        slots = max_num_seqs
        if jobs:
            slots = max(1, min(max_num_seqs, int(kv_tokens // max(context / len(jobs), 1.0))), len(running))
        free_at = [j.steps for j in running] + [0.0] * (slots - len(running))
        heapq.heapify(free_at)
        return cls(tuple(free_at), len(running), sum(j.prefill_tokens for j in running), 0.0).plus(waiting, context)

    def plus(self, jobs: Iterable[Job], context: float | None = None) -> "Backlog":
        """This backlog with `jobs` queued after it, each taking the first slot to come free."""
        return self.place(jobs, context)[0]

    def place(self, jobs: Iterable[Job], context: float | None = None) -> "tuple[Backlog, float]":
        """`plus`, and the step at which the last of `jobs` finishes."""
        free_at, count, prefill, extra, last = list(self.free_at), self.num_requests, self.prefill_tokens, 0.0, 0.0
        for job in jobs:
            finish = heapq.heappop(free_at) + job.steps
            heapq.heappush(free_at, finish)
            count, prefill, extra, last = count + 1, prefill + job.prefill_tokens, extra + job.context_tokens, \
                max(last, finish)
        total = self.context_tokens + extra if context is None else context
        return Backlog(tuple(free_at), count, prefill, total), last

    @property
    def start_step(self) -> float:
        """Steps until a new request could start."""
        return self.free_at[0]

    @property
    def drain_steps(self) -> float:
        return max(self.free_at)

    @property
    def batch(self) -> float:
        """Requests a step of the coming ones holds."""
        return float(max(1, min(len(self.free_at), self.num_requests)))


class StepCostModel:
    """Seconds per step as `overhead + per_prefill_token × prefill + per_decode_token × decodes`, fitted by
    exponentially forgetting least squares with every coefficient kept non-negative."""

    def __init__(self) -> None:
        self._xx = np.zeros((3, 3))  # decayed sums of x xᵀ, x = (1, prefill tokens, decode tokens)
        self._xy = np.zeros(3)
        self._yy = 0.0
        self._fit: tuple[float, float, float] | None = None
        self.num_steps = 0

    def observe(self, num_prefill_tokens: int, num_decode_tokens: int, seconds: float) -> None:
        x = np.array([1.0, num_prefill_tokens, num_decode_tokens])
        self._xx = STEP_DECAY * self._xx + np.outer(x, x)
        self._xy = STEP_DECAY * self._xy + x * seconds
        self._yy = STEP_DECAY * self._yy + seconds * seconds
        self.num_steps += 1
        self._fit = None

    @property
    def ready(self) -> bool:
        return self.num_steps >= MIN_STEPS and self._xx[0, 1] + self._xx[0, 2] > 0

    def coefficients(self) -> tuple[float, float, float]:
        """(overhead s, s per prefill token, s per decode token): the best non-negative fit over every subset of
        the terms (a term the steps seen cannot separate from another drops out)."""
        if self._fit is None:
            best, best_error = (0.0, 0.0, 0.0), math.inf
            for size in (3, 2, 1):
                for terms in itertools.combinations(range(3), size):
                    idx = list(terms)
                    a = self._xx[np.ix_(idx, idx)] + 1e-12 * np.eye(size) * (1.0 + np.trace(self._xx))
                    try:
                        theta = np.linalg.solve(a, self._xy[idx])
                    except np.linalg.LinAlgError:
                        continue
                    if (theta < 0).any():
                        continue
                    full = np.zeros(3)
                    full[idx] = theta
                    error = self._yy - 2 * full @ self._xy + full @ self._xx @ full
                    if error < best_error - 1e-15:
                        best, best_error = tuple(float(v) for v in full), error
            self._fit = best
        return self._fit

    def step_seconds(self, batch: float, prefill_tokens: float) -> float:
        """A step decoding `batch` requests and prefilling `prefill_tokens`."""
        overhead, per_prefill, per_decode = self.coefficients()
        return overhead + per_prefill * prefill_tokens + per_decode * batch
