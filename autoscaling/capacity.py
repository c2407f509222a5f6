"""What one engine replica sustains at the SLO: requests (and tokens) per second, for the requests it sees, with
steps as long as its own steps run.

The model, read off the engine's scheduler: a step costs the step model's `base` plus the work of its tokens;
every waiting prompt is prefilled in the next step (in chunks of `max_num_batched_tokens`, or of
`max_tokens_with_decodes` while others decode, each further chunk a step with the running batch's decodes), every
running request decodes one token per step. At `rate` requests per second, token work fills `rho = rate * E[work]`
of the time and the mean step lasts `base / (1 - rho)`. A request misses

- TTFT when the step running as it arrives, plus a mean step, plus its own prefill, pass `ttft_s`. Steps that
  carry a prefill are the long ones: the chance that one still has more than `x` seconds to run is
  `rate * E[(L - x)+]` (the residual life of a renewal process), with `L` a prefill and a mean step, both
  stretched by `1 + rho_prefill` for the prompts that arrive meanwhile and join the same step;
- ITL when its mean step passes `itl_s`. Over its `output - 1` decode steps a step is the decode part (the base
  and the running batch's tokens: `base * (1 - rho_prefill) / (1 - rho)` in the mean) plus the prefill work of the
  prompts arriving meanwhile, spread over its steps. Only that prefill work is random (the running batch changes
  slowly): compound Poisson over the life's `life * itl_s` seconds at the boundary, so its share per step spreads
  normally by `sqrt(rate * itl_s * E[prefill^2] / life)` around `rho_prefill * itl_s`; or one other prompt's
  prefill alone stalls it by more than its steps leave. (Spreading all the work, decode included, in `rho` space
  put a third of the requests over the ITL at 87% load where the simulated replica had under 1%.)

Behind a load-aware router with other replicas to choose from, a request seldom lands on a replica that is in the
middle of a long prefill (`POOLED_COLLISION_SHARE` of the lone replica's chance), so a replica reports its rate
both alone and as one of several. The sustainable rate is the largest at which the share of requests that miss
stays within `1 - percentile`, counting only requests that can meet the objectives at all: a prompt whose prefill
alone takes longer than `ttft_s` misses on any number of replicas, and must not drive the count. It is bounded
too by `max_num_seqs` decodes at once and by the KV pool at the requests' context. (Checked against the simulated
replica on synthetic request mixes: the rate at which 5% miss, within about 15% either way, alone and beside
three others; tests/test_autoscaling_capacity.py.)

Request sizes are the replica's recent requests (or, before any has finished, the replica profile's held-out
workload); what a step costs is the profile's step model, scaled by how much slower (or faster) this replica's
own steps ran than the model predicts for exactly those batches (a ratio of sums over the last `WINDOW_S`, the
profile's own prediction counting as `PRIOR_S` seconds of steps). A replica sharing its CPU, on another machine,
or serving another model so reports what it really sustains.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from autoscaling.step_model import ReplicaProfile
from autoscaling.workload import SyntheticWorkload

WINDOW_S = 60.0  # steps older than this no longer describe the replica
PRIOR_S = 5.0  # the profile's prediction counts as this many seconds of steps that ran exactly as predicted
BISECTIONS = 16
# Behind a load-aware router, a request lands on a replica in the middle of a long prefill only when the other
# replica it is weighed against is no less loaded: about half as often as on a lone replica (power of two choices).
POOLED_COLLISION_SHARE = 0.5


@dataclass(frozen=True)
class SLO:
    """The service level objectives: time to first token and inter-token latency, each held for `percentile` of
    requests."""

    ttft_s: float = 2.0
    itl_s: float = 0.2
    percentile: float = 0.95

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.itl_s <= 0:
            raise ValueError(f"SLO latencies must be positive; got ttft_s={self.ttft_s}, itl_s={self.itl_s}")
        if not 0.5 <= self.percentile < 1:
            raise ValueError(f"the SLO percentile is a fraction in [0.5, 1); got {self.percentile}")


@dataclass(frozen=True)
class StepStats:
    """One engine step as the capacity model reads it. engine.outputs.SchedulerStats carries the same fields
    (the engine replica hands those in as they are); the simulated replica makes these."""

    time: float
    duration_s: float
    num_prefill_tokens: int
    num_decode_requests: int
    num_context_tokens: int
    prefill_attention: float


@dataclass(frozen=True)
class RequestSizes:
    """Recent requests: prompt tokens, how many of them the prefix cache served, and output tokens."""

    prompt: np.ndarray
    cached: np.ndarray
    output: np.ndarray

    @property
    def computed_tokens(self) -> float:
        """Mean tokens a request costs the engine: its uncached prompt and its output."""
        return float(np.mean(self.prompt - self.cached + self.output))


@dataclass(frozen=True)
class Capacity:
    """What one replica sustains at the SLO, in requests and in computed tokens (uncached prompt plus output) per
    second: alone, and as one of several behind a load-aware router."""

    requests_per_s: float
    tokens_per_s: float
    alone_requests_per_s: float
    alone_tokens_per_s: float
    correction: float  # measured step time / the profile's prediction for the same steps
    feasible_share: float  # requests that can meet the objectives at all


class CapacityModel:
    """The profile's step model and engine shape, and the SLO it is held to."""

    def __init__(self, profile: ReplicaProfile, slo: SLO) -> None:
        self.model = profile.step_model
        self.engine = profile.engine
        self.slo = slo
        validation = (profile.validation or {}).get("workload")
        prior = SyntheticWorkload(**validation).requests() if validation else SyntheticWorkload(64).requests()
        self.prior = RequestSizes(np.array([r.prompt_tokens for r in prior], dtype=float),
                                  np.zeros(len(prior)), np.array([r.output_tokens for r in prior], dtype=float))

    def capacity(self, sizes: RequestSizes | None, correction: float = 1.0) -> Capacity:
        sizes = sizes if sizes is not None and len(sizes.prompt) else self.prior
        m, engine = self.model, self.engine
        computed = np.maximum(sizes.prompt - sizes.cached, 1.0)
        chunks = np.ceil(computed / engine.max_num_batched_tokens)
        attention = computed * (sizes.cached + computed / 2) / 1e6
        prefill = correction * (m.prefill_token * computed + m.prefill_attention * attention)
        context = sizes.prompt + sizes.output / 2
        decode = correction * sizes.output * (m.decode_seq + m.context_token * context)
        base = correction * m.base
        feasible = prefill + (chunks + 1) * base <= self.slo.ttft_s
        share = float(feasible.mean())
        # At most max_num_seqs decodes at once, and as many as the KV pool holds at the requests' context:
        # rate * output * step <= concurrent, with step = base / (1 - rate * work).
        concurrent = min(engine.max_num_seqs,
                         engine.num_kv_blocks * engine.block_size / max(float(np.mean(context)), 1.0))
        bound = concurrent / (float(np.mean(sizes.output)) * base + concurrent * float(np.mean(prefill + decode)))
        rates = []
        for collision_share in (1.0, POOLED_COLLISION_SHARE):
            misses = _Misses(self.slo, prefill, decode, sizes.output, base, feasible, collision_share,
                             computed, engine.budget_beside_decodes)
            rates.append(min(bound, misses.sustainable_rate()) if share else 0.0)
        tokens = sizes.computed_tokens
        return Capacity(rates[1], rates[1] * tokens, rates[0], rates[0] * tokens, correction, share)


class _Misses:
    """The share of feasible requests that miss an objective, as a function of the request rate."""

    def __init__(self, slo: SLO, prefill: np.ndarray, decode: np.ndarray, output: np.ndarray, base: float,
                 feasible: np.ndarray, collision_share: float = 1.0, computed: np.ndarray | None = None,
                 budget: float = float("inf")) -> None:
        self.slo, self.base, self.collision_share = slo, base, collision_share
        self.prefill_work, self.decode_work = float(np.mean(prefill)), float(np.mean(decode))
        self.sorted_prefill = np.sort(prefill)
        self.tail_sums = np.concatenate([np.cumsum(self.sorted_prefill[::-1])[::-1], [0.0]])
        self.prefill_square = float(np.mean(prefill**2))  # E[p^2]: the spread of the prefill work arriving
        self.feasible = feasible
        self.mine = prefill[feasible] + base  # each feasible request's own prefill, with its step's base
        self.life = np.maximum(output[feasible] - 1, 0)
        # Beside running decodes a step takes at most `budget` tokens, decodes included: a longer prompt takes a
        # step more for each further chunk, each carrying the running batch's decodes, and prompts queue for the
        # room the decodes leave.
        self.budget, self.mean_output = budget, float(np.mean(output))
        self.computed = np.zeros(len(prefill)) if computed is None else computed
        self.extra_chunks = np.maximum(np.ceil(self.computed[feasible] / budget) - 1, 0)

    def sustainable_rate(self) -> float:
        low, high = 0.0, 1.0 / (self.prefill_work + self.decode_work)
        for _ in range(BISECTIONS):
            mid = (low + high) / 2
            low, high = (mid, high) if self.missed(mid) <= 1 - self.slo.percentile else (low, mid)
        return low

    def missed(self, rate: float) -> float:
        slo, n = self.slo, len(self.sorted_prefill)
        rho_prefill, rho_decode = rate * self.prefill_work, rate * self.decode_work
        if rho_prefill + rho_decode >= 1:
            return 1.0
        step = self.base / (1 - rho_prefill - rho_decode)
        stretch = 1 + rho_prefill
        decode_step = self.base * (1 - rho_prefill) / (1 - rho_prefill - rho_decode)
        # TTFT: the residual of a running prefill step, (step + prefill) * stretch, past slack / stretch.
        slack = slo.ttft_s - step - self.mine - self.extra_chunks * decode_step
        y = np.maximum(slack, 0) / stretch**2 - step - self.base
        above = np.searchsorted(self.sorted_prefill, y, side="right")
        excess = (self.tail_sums[above] - y * (n - above)) / n
        ttft = np.where(slack < 0, 1.0, self.collision_share * rate * stretch * excess)
        if self.budget < float("inf"):
            ttft = np.maximum(ttft, self._queued_for_budget(rate, step))
        # ITL: a request's mean step is the decode part of a step (base and the running batch: the fluid share
        # base * (1 - rho_prefill) / (1 - rho)) plus the prefill work landing within its life, spread over its
        # steps. That work is compound Poisson over the life's `life * itl_s` seconds at the boundary: it passes
        # `itl_s` when the work spread over its steps passes what the decode part leaves (a normal tail, mean
        # `rho_prefill * itl_s`, variance `rate * itl_s * E[p^2] / life`), or one prefill alone does.
        left = slo.itl_s - decode_step
        spread = np.sqrt(rate * slo.itl_s * self.prefill_square / np.maximum(self.life, 1))
        busy = 0.5 * _erfc((left - rho_prefill * slo.itl_s) / np.maximum(spread, 1e-12) / np.sqrt(2))
        threshold = left * self.life
        single = rate * self.life * step * (n - np.searchsorted(self.sorted_prefill, threshold, side="right")) / n
        itl = np.where(self.life == 0, 0.0, np.where(threshold <= 0, 1.0, np.maximum(busy, single)))
        return float(np.mean(np.minimum(1.0, ttft + itl)))

    def _queued_for_budget(self, rate: float, step: float) -> np.ndarray:
        """Each feasible request's chance to miss TTFT waiting for step budget: prompts are served, in order, by
        the tokens the decoding requests (`rate * output * step` of them at once, by Little's law) leave of each
        step's budget, an M/G/1 queue whose wait passes `x` with chance about `u * exp(-x (1 - u) 2 E[S] / E[S^2])`
        (Kingman's exponential tail; `u` the share of steps with a prompt to serve, `S` a prompt's service)."""
        room = self.budget - rate * self.mean_output * step
        if room <= 0:
            return np.ones(len(self.mine))
        service = self.computed / room * step
        u = rate * float(np.mean(service))
        if u >= 1:
            return np.ones(len(self.mine))
        x = self.slo.ttft_s - step - service[self.feasible]
        decay = (1 - u) * 2 * float(np.mean(service)) / max(float(np.mean(service**2)), 1e-12)
        return np.where(x <= 0, 1.0, self.collision_share * u * np.exp(-np.maximum(x, 0) * decay))


def _erfc(x: np.ndarray) -> np.ndarray:
    """Complementary error function (Abramowitz and Stegun 7.1.26, error below 1.5e-7): numpy has none."""
    z = np.abs(x)
    t = 1 / (1 + 0.3275911 * z)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    tail = poly * np.exp(-z * z)
    return np.where(x >= 0, tail, 2 - tail)


class StepWindow:
    """The replica's steps of the last `window_s` seconds, as running sums of their measured and predicted time."""

    def __init__(self, model: CapacityModel, window_s: float = WINDOW_S) -> None:
        self.model = model
        self.window_s = window_s
        self._steps: deque[tuple[float, float, float]] = deque()  # (start, measured, predicted)
        self._measured = self._predicted = 0.0
        self.last_time = float("-inf")

    def add(self, step: StepStats) -> None:
        predicted = self.model.model.seconds(step.num_prefill_tokens, step.num_decode_requests,
                                             step.num_context_tokens, step.prefill_attention)
        self._steps.append((step.time, step.duration_s, predicted))
        self._measured += step.duration_s
        self._predicted += predicted
        self.last_time = max(self.last_time, step.time)

    def add_new(self, steps: list[StepStats]) -> None:
        """Adds the steps of a ring snapshot that are newer than the last one added."""
        for step in steps:
            if step.time > self.last_time:
                self.add(step)

    def correction(self, now: float) -> float:
        while self._steps and self._steps[0][0] < now - self.window_s:
            _, measured, predicted = self._steps.popleft()
            self._measured -= measured
            self._predicted -= predicted
        if not self._steps:
            self._measured = self._predicted = 0.0
        return (self._measured + PRIOR_S) / (self._predicted + PRIOR_S)
