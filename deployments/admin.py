"""What the ingress's admin endpoints do: fan out to every engine replica for the step trace and the profiler.

A handle call reaches one replica; `DeploymentHandle.broadcast` (Ray Serve 2.60) reaches every running one.
A replica that does not answer in time is left out of the answer and logged.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from pydantic import BaseModel
from ray.serve.handle import DeploymentHandle

from deployments.chrome_trace import chrome_trace
from deployments.errors import OpenAIError
from deployments.records import ProfileResult, ReplicaSteps
from deployments.timeline_recorder import TimelineRecorder

log = logging.getLogger(__name__)

BROADCAST_TIMEOUT_S = 60.0  # writing a long profile takes a while
MAX_TRACE_SECONDS = 600.0


class ReplicaProfile(BaseModel):
    replica_id: str
    running: bool
    changed: bool
    path: str | None = None


class ProfileReply(BaseModel):
    profiling: bool
    replicas: list[ReplicaProfile]


async def broadcast(handle: DeploymentHandle, method: str, *args: Any) -> list[Any]:
    results = await handle.broadcast(method, *args).results_async(timeout_s=BROADCAST_TIMEOUT_S,
                                                                 return_exceptions=True)
    for failed in [r for r in results if isinstance(r, BaseException)]:
        log.warning("an engine replica did not answer %s: %r", method, failed)
    return [r for r in results if not isinstance(r, BaseException)]


async def trace(handle: DeploymentHandle, recorder: TimelineRecorder, seconds: float) -> dict[str, Any]:
    if not recorder.enabled:
        raise OpenAIError(404, "the step trace is off (timeline.enabled: false)", code="timelines_disabled")
    if not 0 < seconds <= MAX_TRACE_SECONDS:
        raise OpenAIError(400, f"seconds must be in (0, {MAX_TRACE_SECONDS:g}]; got {seconds:g}", "seconds")
    until = time.time()
    since = until - seconds
    replicas: list[ReplicaSteps] = await broadcast(handle, "step_trace", since)
    timelines = [t.view() for t in recorder.store.since(since)]
    return chrome_trace(replicas, timelines, since, until)


async def start_profile(handle: DeploymentHandle, profiler_dir: str | None) -> ProfileReply:
    _check_profiler(profiler_dir)
    reply = _reply(await broadcast(handle, "start_profile"))
    if not any(r.changed for r in reply.replicas):
        raise OpenAIError(409, "the profiler is already running on every engine replica (POST /stop_profile)",
                          code="profiler_running", type="invalid_request_error")
    return reply


async def stop_profile(handle: DeploymentHandle, profiler_dir: str | None) -> ProfileReply:
    _check_profiler(profiler_dir)
    reply = _reply(await broadcast(handle, "stop_profile"))
    if not any(r.changed for r in reply.replicas):
        raise OpenAIError(409, "the profiler is not running (POST /start_profile)", code="profiler_not_running",
                          type="invalid_request_error")
    return reply


def _check_profiler(profiler_dir: str | None) -> None:
    if not profiler_dir:
        raise OpenAIError(404, "profiling is off: start the app with profiler_dir set (a folder on each engine "
                               "replica's node)", code="profiler_disabled")


def _reply(results: list[ProfileResult]) -> ProfileReply:
    replicas = [ReplicaProfile(replica_id=r.replica_id, running=r.running, changed=r.changed, path=r.path)
                for r in sorted(results, key=lambda r: r.replica_id)]
    return ProfileReply(profiling=any(r.running for r in replicas), replicas=replicas)
