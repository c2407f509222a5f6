"""The PyTorch profiler around the engine's step loop.

torch.profiler records the thread it was started on, so `start` and `stop` must run on the step thread
(AsyncEngine.run_on_step_thread); writing the trace can happen anywhere afterwards.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger(__name__)


class StepProfiler:
    def __init__(self, device: str = "cpu") -> None:
        self.activities = [ProfilerActivity.CPU]
        if device.startswith("cuda") and torch.cuda.is_available():
            self.activities.append(ProfilerActivity.CUDA)
        self._profile: profile | None = None

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self) -> bool:
        """Starts profiling this thread; False if it was already running."""
        if self._profile is not None:
            return False
        self._profile = profile(activities=self.activities, record_shapes=True)
        self._profile.start()
        log.info("torch profiler started")
        return True

    def stop(self) -> profile | None:
        """Stops profiling and returns the finished profile (None if it was not running)."""
        finished, self._profile = self._profile, None
        if finished is not None:
            finished.stop()
            log.info("torch profiler stopped")
        return finished


def write_chrome_trace(finished: profile, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    finished.export_chrome_trace(str(path))
    return path
