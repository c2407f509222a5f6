"""The queue + KV policy on the real app: engine replicas scale 1 -> 2 under sustained load and back to 1 after it,
and no request is lost on the way down. Redeploys the session's app, then puts it back as it found it."""
from __future__ import annotations

import asyncio
import random
import time

import pytest
from openai import AsyncOpenAI
from ray import serve

from autoscaling.policy import QueueKVConfig
from deployments.autoscaling_config import AutoscalingArgs
from deployments.local import APP_NAME

pytestmark = [pytest.mark.slow, pytest.mark.serve, pytest.mark.disruptive]

# Short delays and windows so the whole cycle fits in a test; the thresholds are the defaults.
FAST = AutoscalingArgs(enabled=True, min_replicas=1, max_replicas=2, upscale_delay_s=2.0, downscale_delay_s=5.0,
                       look_back_period_s=2.0, metrics_interval_s=0.5,
                       queue_kv=QueueKVConfig(scale_down_cooldown_s=5.0))
HEAVY_STREAMS = 32  # with ~100-token prompts and 128 output tokens each, well past one replica's 384 KV blocks
HOLD_UNDER_LOAD_S = 10.0  # after scaling out, the load stays this long: the count must not flap back meanwhile
SCALE_UP_TIMEOUT_S = 120.0
SCALE_DOWN_TIMEOUT_S = 90.0


def running_engine_replicas() -> int:
    app = serve.status().applications.get(APP_NAME)
    deployment = app.deployments.get("EngineReplica") if app else None
    return deployment.replica_states.get("RUNNING", 0) if deployment else 0


def alive_engine_replicas() -> int:
    app = serve.status().applications.get(APP_NAME)
    deployment = app.deployments.get("EngineReplica") if app else None
    return sum(deployment.replica_states.values()) if deployment else 0


async def wait_for(condition, timeout_s: float, what: str) -> float:
    """Seconds until `condition()` held; fails the test past `timeout_s`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what} did not happen within {timeout_s:.0f}s "
                                 f"(running engine replicas: {running_engine_replicas()})")
        await asyncio.sleep(0.5)
    return time.monotonic() - start


class Streams:
    """Closed-loop streaming completions: each of `concurrency` workers sends one after another until stopped.
    Records every request's outcome; none is cancelled, so stopping lets the ones in flight finish."""

    def __init__(self, client: AsyncOpenAI, model: str, concurrency: int, max_tokens: int, prompt_words: int,
                 seed: int) -> None:
        self.client, self.model, self.max_tokens = client, model, max_tokens
        self.rng = random.Random(seed)
        self.prompt_words = prompt_words
        self.stopped = asyncio.Event()
        self.completed: list[int] = []  # completion tokens of each request that finished
        self.errors: list[str] = []
        self.tasks = [asyncio.create_task(self._worker()) for _ in range(concurrency)]

    async def _worker(self) -> None:
        while not self.stopped.is_set():
            prompt = " ".join(self.rng.choice(["red", "green", "blue", "sea", "sky", "tree", "stone", "river"])
                              for _ in range(self.prompt_words))
            try:
                stream = await self.client.completions.create(
                    model=self.model, prompt=prompt, max_tokens=self.max_tokens, temperature=0.8, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                usage = None
                async for chunk in stream:
                    usage = chunk.usage or usage
                self.completed.append(usage.completion_tokens if usage else -1)
            except Exception as exc:  # recorded, and the test fails on it
                self.errors.append(repr(exc))

    async def stop(self) -> None:
        self.stopped.set()
        await asyncio.wait_for(asyncio.gather(*self.tasks), timeout=120)


def test_engine_replicas_scale_out_under_load_and_back_in_after_it_without_losing_requests(serve_app):
    original = serve_app.args
    scaled = original.model_copy(update={"num_engine_replicas": 1, "autoscaling": FAST})

    async def scenario() -> tuple[float, float, Streams, Streams]:
        await wait_for(lambda: alive_engine_replicas() == 1 and running_engine_replicas() == 1, 120,
                       "the autoscaled app settling on its initial replica")
        async with AsyncOpenAI(base_url=f"{serve_app.base_url}/v1", api_key="unused", timeout=180,
                               max_retries=0) as client:
            heavy = Streams(client, serve_app.model, HEAVY_STREAMS, max_tokens=128, prompt_words=100, seed=1)
            up_s = await wait_for(lambda: running_engine_replicas() == 2, SCALE_UP_TIMEOUT_S,
                                  "scaling out to 2 engine replicas under load")
            held = []
            for _ in range(int(HOLD_UNDER_LOAD_S / 0.5)):
                held.append(running_engine_replicas())
                await asyncio.sleep(0.5)
            assert set(held) == {2}, f"the replica count changed under steady load: {held}"
            # The load goes; a trickle stays, so requests are in flight while a replica drains away.
            trickle = Streams(client, serve_app.model, 2, max_tokens=24, prompt_words=20, seed=2)
            stopped = time.monotonic()
            await heavy.stop()  # no new heavy requests; the ones in flight finish, maybe while a replica drains
            await wait_for(lambda: alive_engine_replicas() == 1, SCALE_DOWN_TIMEOUT_S,
                           "scaling back in to 1 engine replica after the load")
            down_s = time.monotonic() - stopped
            await trickle.stop()
            return up_s, down_s, heavy, trickle

    try:
        serve_app.redeploy(scaled)
        up_s, down_s, heavy, trickle = asyncio.run(scenario())
    finally:
        serve_app.redeploy(original)
        deadline = time.monotonic() + 180
        while running_engine_replicas() != original.num_engine_replicas and time.monotonic() < deadline:
            time.sleep(1)
    assert running_engine_replicas() == original.num_engine_replicas

    print(f"scaled out after {up_s:.1f}s of load, back in {down_s:.1f}s after it; "
          f"{len(heavy.completed)} heavy and {len(trickle.completed)} trickle requests")
    assert not heavy.errors and not trickle.errors, (heavy.errors + trickle.errors)[:5]
    assert heavy.completed and all(n == 128 for n in heavy.completed), heavy.completed
    assert trickle.completed and all(n == 24 for n in trickle.completed), trickle.completed
