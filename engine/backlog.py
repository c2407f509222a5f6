"""An engine's backlog in seconds, from its own step history: what admission and routing compare with a deadline.

The work still owed is counted in tokens: prompt tokens not computed yet, and the output tokens its requests are
expected to still produce (each request's `max_tokens`, capped by the running average of real output lengths
unless it ignores EOS). Its time comes from a model of this engine's steps, fitted to the steps it ran:
`step seconds = overhead + per_prefill_token × prefill tokens + per_decode_token × decoding requests`
(non-negative least squares, recent steps weighing most). A decode token costs more than a prompt token (a
matrix-vector row and a pass over its whole context, against a row of a matrix product), and a step's fixed
overhead is why throughput grows with the batch: draining N decode tokens takes N / batch steps, each paying it.
"""
from __future__ import annotations

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
class Work:
    """Tokens an engine owes, and how they are shaped into steps."""

    prefill_tokens: int = 0
    decode_tokens: float = 0.0
    longest_decode: float = 0.0  # decode steps the longest request alone still needs
    num_requests: int = 0
    context_tokens: float = 0.0  # KV footprint the requests reach: bounds how many run at once

    def __add__(self, other: "Work") -> "Work":
        return Work(self.prefill_tokens + other.prefill_tokens, self.decode_tokens + other.decode_tokens,
                    max(self.longest_decode, other.longest_decode), self.num_requests + other.num_requests,
                    self.context_tokens + other.context_tokens)


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

    def work_of(self, request: Request) -> Work:
        if request.is_finished:
            return Work()
        return self._work(request.num_tokens, request.num_computed_tokens, request.num_output_tokens,
                          request.sampling_params)

    def work_of_new(self, num_prompt_tokens: int, params: SamplingParams) -> Work:
        """A request not queued yet."""
        return self._work(num_prompt_tokens, 0, 0, params)

    def _work(self, num_tokens: int, num_computed: int, produced: int, params: SamplingParams) -> Work:
        left = min(max(self.expected(params) - produced, 1.0), params.max_tokens - produced)
        # Every token but the last is prefill (a preempted request recomputes its output too); each output token
        # after that costs one decode step, and the prefill step yields the first one.
        prefill = max(num_tokens - num_computed - 1, 0)
        return Work(prefill, left, left, 1, num_tokens + left)

    def work(self, requests: Iterable[Request]) -> Work:
        """The sum of `work_of`, without a record per request: it runs after every step."""
        prefill, decode, longest, count, context = 0, 0.0, 0.0, 0, 0.0
        for request in requests:
            if request.is_finished:
                continue
            one = self.work_of(request)
            prefill += one.prefill_tokens
            decode += one.decode_tokens
            longest = max(longest, one.longest_decode)
            count += 1
            context += one.context_tokens
        return Work(prefill, decode, longest, count, context)


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

    def seconds(self, work: Work, max_num_seqs: int, max_num_batched_tokens: int, kv_tokens: int) -> float:
        """Time to drain `work`: its decode steps at the batch the engine can hold, its prefill in full steps."""
        if work.num_requests == 0:
            return 0.0
        overhead, per_prefill, per_decode = self.coefficients()
        per_request = work.context_tokens / work.num_requests
        batch = max(1.0, min(max_num_seqs, work.num_requests, kv_tokens / max(per_request, 1.0)))
        steps = max(work.longest_decode, work.decode_tokens / batch,
                    math.ceil(work.prefill_tokens / max_num_batched_tokens))
        return overhead * steps + per_prefill * work.prefill_tokens + per_decode * work.decode_tokens
