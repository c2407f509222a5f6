"""The engine's own decode step at a level's full batch, read from its step records, for a server and for its
in-process engine alike: whether the served engine loses its share inside its steps (slower steps: the processes
beside it take CPU from its threads) or between them (idle, waiting for requests or for its own event loop).

A step record here is (start, duration_s, prefill tokens, decoding requests): `SchedulerStats` in process, the
`step` spans of `GET /debug/trace` from a server (`deployments/chrome_trace.py`).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Iterable

StepRecord = tuple[float, float, int, int]  # (start s, duration s, prefill tokens, decoding requests)


@dataclass(frozen=True)
class StepFigures:
    full_batch_steps: int  # decode-only steps that carried every stream of the level
    decode_step_ms: float | None  # their median duration
    busy_share: float | None  # the steps' time over the span from the first one's start to the last one's end


def step_figures(steps: Iterable[StepRecord], concurrency: int) -> StepFigures:
    records = sorted(steps)
    full = [duration for _, duration, prefill, decoding in records if prefill == 0 and decoding == concurrency]
    span = records[-1][0] + records[-1][1] - records[0][0] if records else 0.0
    return StepFigures(len(full), statistics.median(full) * 1000 if full else None,
                       sum(r[1] for r in records) / span if span > 0 else None)


def trace_steps(trace: dict[str, Any]) -> list[StepRecord]:
    """The step spans of a `GET /debug/trace` reply (microseconds from its window's start) as step records."""
    return [(event["ts"] / 1e6, event["dur"] / 1e6, event["args"]["prefill_tokens"],
             event["args"]["decode_sequences"])
            for event in trace.get("traceEvents", []) if event.get("cat") == "step" and event.get("ph") == "X"]
