"""An engine's backlog in seconds, from its own step history: what admission and routing compare with a deadline.

The work still owed is counted in tokens: prompt tokens not computed yet, and the output tokens its requests are
expected to still produce (each request's `max_tokens`, capped by the running average of real output lengths
unless it ignores EOS). Its time comes from a model of this engine's steps, fitted to the steps it ran:
`step seconds = overhead + per_token × tokens` (least squares, recent steps weighing most). A step's fixed
overhead is why throughput grows with the batch: draining N decode tokens takes N / batch steps, each paying it.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

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
    """Seconds per step as `overhead + per_token × tokens`, by exponentially forgetting least squares."""

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.num_steps = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = STEP_DECAY
        self._w = d * self._w + 1.0
        self._x = d * self._x + num_tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + num_tokens * num_tokens
        self._xy = d * self._xy + num_tokens * seconds
        self.num_steps += 1

    @property
    def ready(self) -> bool:
        return self.num_steps >= MIN_STEPS and self._x > 0

    def coefficients(self) -> tuple[float, float]:
        """(overhead s, seconds per token); a pure rate (no overhead) when the steps seen do not separate them."""
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x > (0.1 * mean_x) ** 2:
            per_token = (self._xy / self._w - mean_x * mean_y) / var_x
            overhead = mean_y - per_token * mean_x
            if per_token > 0 and overhead >= 0:
                return overhead, per_token
        return 0.0, mean_y / mean_x

    def seconds(self, work: Work, max_num_seqs: int, max_num_batched_tokens: int, kv_tokens: int) -> float:
        """Time to drain `work`: its decode steps at the batch the engine can hold, its prefill in full steps."""
        if work.num_requests == 0:
            return 0.0
        overhead, per_token = self.coefficients()
        per_request = work.context_tokens / work.num_requests
        batch = max(1.0, min(max_num_seqs, work.num_requests, kv_tokens / max(per_request, 1.0)))
        steps = max(work.longest_decode, work.decode_tokens / batch,
                    math.ceil(work.prefill_tokens / max_num_batched_tokens))
        return overhead * steps + per_token * (work.prefill_tokens + work.decode_tokens)
