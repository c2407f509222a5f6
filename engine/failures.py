"""How a request can fail inside the engine, and which failures the engine survives.

A step that raises fails the requests of its batch (each gets a RequestFailure on its final output) and the step
loop goes on. Only an error that leaves the engine's state unknown is fatal: a device error (the device may have
dropped the work of every request, or be unusable), a failure while freeing a batch's blocks (the pool's counts
can no longer be trusted), anything raised outside a step, or a BaseException that is not an Exception.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class FailureKind(enum.Enum):
    INVALID_REQUEST = "invalid_request"  # the request's own input: the caller must change it
    STEP_FAILED = "step_failed"  # the engine failed the batch the request was in: not the caller's doing
    DEADLINE_PASSED = "deadline_passed"  # dropped from the queue: it could no longer finish in time


@dataclass(frozen=True)
class RequestFailure:
    kind: FailureKind
    message: str  # for the caller: what happened and what to do; never an exception's text or a traceback
    code: str
    param: str | None = None


class EngineFatalError(RuntimeError):
    """The engine can no longer vouch for its state; the process holding it must go."""


# Errors torch raises as plain RuntimeErrors when the device itself failed.
DEVICE_ERROR_MARKERS = ("CUDA error", "device-side assert", "CUBLAS_STATUS", "CUDNN_STATUS", "NCCL error",
                        "HIP error", "illegal memory access", "an illegal instruction")


def leaves_state_unknown(exc: BaseException) -> bool:
    if not isinstance(exc, Exception) or isinstance(exc, (EngineFatalError, MemoryError)):
        return True
    if isinstance(exc, getattr(torch, "AcceleratorError", EngineFatalError)):
        return True
    text = str(exc)
    return any(marker in text for marker in DEVICE_ERROR_MARKERS)
