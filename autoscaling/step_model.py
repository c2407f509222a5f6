"""How long one engine step takes, as a function of the batch it runs: a linear model fitted to measured steps.

    seconds = base + prefill_token * P + decode_seq * D + context_token * C + prefill_attention * A

P: prompt tokens computed this step (all prefill chunks); D: requests decoding one token; C: tokens of KV the
decodes attend to (their context lengths, summed); A: the prefill chunks' attention work, sum of
chunk * (tokens before it + chunk / 2), in millions. Linear layers cost per token (P, D), decode attention per
context token (C), prefill attention grows with the square of a chunk (A); base is the per-step dispatch.
The samples come from `benchmarks/step_profile.py`, which runs the real engine and writes a profile JSON.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

FEATURES = ("base", "prefill_token", "decode_seq", "context_token", "prefill_attention")


@dataclass(frozen=True)
class StepSample:
    """One measured step."""

    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    prefill_attention: float  # millions of (query, key) pairs in the prefill chunks
    seconds: float


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds per term; every coefficient is non-negative."""

    base: float
    prefill_token: float
    decode_seq: float
    context_token: float
    prefill_attention: float

    def seconds(self, prefill_tokens: int, decode_seqs: int, context_tokens: int, prefill_attention: float) -> float:
        return (self.base + self.prefill_token * prefill_tokens + self.decode_seq * decode_seqs
                + self.context_token * context_tokens + self.prefill_attention * prefill_attention)

    def predict(self, sample: StepSample) -> float:
        return self.seconds(sample.prefill_tokens, sample.decode_seqs, sample.context_tokens,
                            sample.prefill_attention)

    @classmethod
    def fit(cls, samples: list[StepSample], relative: bool = True, trim_slow: float | None = None,
            rounds: int = 3) -> "StepTimeModel":
        """Non-negative least squares. `relative` weighs each step by 1 / its time, so short decode steps count as
        much as long prefills; without it the residuals sum to zero, so the fitted steps add up to the measured
        time. `trim_slow` drops steps that took that fraction longer than the fit and refits (`rounds` times):
        on a shared machine a step that lost its core to another process says nothing about the engine."""
        if len(samples) < len(FEATURES):
            raise ValueError(f"need at least {len(FEATURES)} step samples to fit, got {len(samples)}")
        x = np.array([_features(s) for s in samples], dtype=np.float64)
        y = np.array([s.seconds for s in samples], dtype=np.float64)
        keep = np.ones(len(y), dtype=bool)
        for _ in range(rounds if trim_slow is not None else 1):
            weights = 1.0 / np.maximum(y[keep], 1e-4) if relative else np.ones(int(keep.sum()))
            coefs = _nnls(x[keep] * weights[:, None], y[keep] * weights)
            if trim_slow is None:
                break
            keep = y <= (x @ coefs) * (1 + trim_slow)
        return cls(*(float(c) for c in coefs))

    def relative_errors(self, samples: list[StepSample]) -> np.ndarray:
        predicted = np.array([self.predict(s) for s in samples])
        measured = np.array([s.seconds for s in samples])
        return (predicted - measured) / measured


def _features(s: StepSample) -> list[float]:
    return [1.0, s.prefill_tokens, s.decode_seqs, s.context_tokens, s.prefill_attention]


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: drop the most negative term and refit until none is negative
    (a simple active-set stand-in for Lawson-Hanson, enough for five terms that each cost time)."""
    active = list(range(a.shape[1]))
    while True:
        coefs, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (coefs >= 0).all() or len(active) == 1:
            out = np.zeros(a.shape[1])
            out[active] = np.maximum(coefs, 0)
            return out
        active.pop(int(np.argmin(coefs)))


@dataclass(frozen=True)
class EngineShape:
    """The engine settings a profile was measured with; the simulated scheduler uses the same."""

    block_size: int
    num_kv_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_tokens_with_decodes: int | None = None  # the budget of a step that carries decodes (None: the same)

    def budget(self, decoding: int) -> int:
        """A step's tokens with `decoding` requests decoding in it: engine.scheduler.step_budget, restated here (the
        autoscaling package does not import the engine; tests/test_autoscaling_simulator.py checks they agree)."""
        full, cap = self.max_num_batched_tokens, self.max_tokens_with_decodes
        if cap is None or cap >= full or not decoding:
            return full
        return min(full, max(cap, decoding))

    @property
    def budget_beside_decodes(self) -> int:
        """The prompt tokens a step takes while others decode (about: the decodes' own tokens aside)."""
        return min(self.max_num_batched_tokens, self.max_tokens_with_decodes or self.max_num_batched_tokens)


@dataclass(frozen=True)
class ReplicaProfile:
    """A fitted step model, the engine it was measured on, and a held-out run to check predictions against."""

    name: str
    step_model: StepTimeModel
    engine: EngineShape
    description: str = ""
    validation: dict | None = None  # {"workload": SyntheticWorkload fields, "measured": {...}} (step_profile.py)

    @classmethod
    def load(cls, path: str | Path) -> "ReplicaProfile":
        data = json.loads(Path(path).read_text())
        return cls(name=data["name"], step_model=StepTimeModel(**data["step_model"]),
                   engine=EngineShape(**data["engine"]), description=data.get("description", ""),
                   validation=data.get("validation"))

    def to_json(self, extra: dict | None = None) -> str:
        data = {"name": self.name, "description": self.description, "step_model": asdict(self.step_model),
                "engine": asdict(self.engine), "validation": self.validation, **(extra or {})}
        return json.dumps(data, indent=2)


PROFILES = Path(__file__).parent / "profiles"
DEFAULT_PROFILE = PROFILES / "smollm2-135m-cpu-bf16.json"
