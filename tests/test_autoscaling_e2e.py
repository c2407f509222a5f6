"""Autoscaling on the real app: the queue + KV policy scales engine replicas 1 -> 2 under sustained load and back to 1
after it, losing no request on the way down; the SLO policy scales an idle app to zero replicas, and requests that
arrive then wait at the ingress until the first replica has started, none lost. Each test redeploys the session's
app; the module puts it back as it found it."""
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
from deployments.records import ColdStart

pytestmark = [pytest.mark.slow, pytest.mark.serve, pytest.mark.disruptive]

# Short delays and windows so the whole cycle fits in a test; the thresholds are the defaults. The cooldown is, as
# the README asks of it, at least the time the backlog that called the new replica takes to drain: every heavy
# request lands on the first replica before the second runs, and their 32 x 128 tokens take it about 20 s here,
# while their KV grows from half of what one replica holds to more than it.
FAST = AutoscalingArgs(enabled=True, min_replicas=1, max_replicas=2, upscale_delay_s=2.0, downscale_delay_s=5.0,
                       look_back_period_s=2.0, metrics_interval_s=0.5,
                       queue_kv=QueueKVConfig(scale_down_cooldown_s=15.0))
HEAVY_STREAMS = 32  # with ~100-token prompts and 128 output tokens each, well past one replica's 384 KV blocks
HOLD_UNDER_LOAD_S = 10.0  # after scaling out, the load stays this long: the count must not flap back meanwhile
SCALE_UP_TIMEOUT_S = 120.0
SCALE_DOWN_TIMEOUT_S = 120.0


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


MAX_REQUESTS_PER_WORKER = 1000  # a bound on each closed-loop worker, far past what a scenario sends


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
        for _ in range(MAX_REQUESTS_PER_WORKER):
            if self.stopped.is_set():
                return
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
                # This worker stops: a request that fails at once (a closed client, after the scenario failed)
                # returns without yielding to the event loop, so sending on would spin and never see a cancel.
                return

    async def stop(self) -> None:
        self.stopped.set()
        await asyncio.wait_for(asyncio.gather(*self.tasks), timeout=120)


# Each test deploys its own arguments over whatever the last disruptive test left (tests/conftest.py).
def test_engine_replicas_scale_out_under_load_and_back_in_after_it_without_losing_requests(serve_app):
    scaled = serve_app.started_args.model_copy(update={"num_engine_replicas": 1, "autoscaling": FAST})

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

    serve_app.redeploy(scaled)
    up_s, down_s, heavy, trickle = asyncio.run(scenario())
    print(f"scaled out after {up_s:.1f}s of load, back in {down_s:.1f}s after it; "
          f"{len(heavy.completed)} heavy and {len(trickle.completed)} trickle requests")
    assert not heavy.errors and not trickle.errors, (heavy.errors + trickle.errors)[:5]
    assert heavy.completed and all(n == 128 for n in heavy.completed), heavy.completed
    assert trickle.completed and all(n == 24 for n in trickle.completed), trickle.completed


# The SLO policy from zero: an idle app goes to zero replicas 2 s after its last request left the replicas'
# 10 s arrival window; requests that come then wait at the ingress.
FROM_ZERO = AutoscalingArgs(enabled=True, policy="slo", min_replicas=0, max_replicas=2, upscale_delay_s=2.0,
                            downscale_delay_s=5.0, downscale_to_zero_delay_s=2.0, look_back_period_s=2.0,
                            metrics_interval_s=0.5)
FIRST_REQUESTS = 4
# After its constructor returns, a replica passes Serve's first health check and every handle learns of it.
ROUTABLE_AFTER_READY_S = 5.0


def test_from_zero_replicas_the_first_requests_are_answered_once_one_has_started_none_lost(serve_app):
    serve_app.redeploy(serve_app.started_args.model_copy(update={"num_engine_replicas": 1, "autoscaling": FROM_ZERO}))

    async def ask(client: AsyncOpenAI) -> tuple[float, int]:
        """Seconds to the whole answer, and its completion tokens."""
        sent = time.monotonic()
        reply = await client.completions.create(model=serve_app.model, prompt="The sea at dawn is", max_tokens=24,
                                                temperature=0.0, extra_body={"ignore_eos": True})
        return time.monotonic() - sent, reply.usage.completion_tokens

    async def scenario() -> tuple[float, float, list[tuple[float, int]]]:
        async with AsyncOpenAI(base_url=f"{serve_app.base_url}/v1", api_key="unused", timeout=300,
                               max_retries=0) as client:
            own_s, _ = await ask(client)  # the request's own latency, on a started replica
            await wait_for(lambda: alive_engine_replicas() == 0, 90, "scaling an idle app to zero replicas")
            sent_at = time.time()
            answers = await asyncio.gather(*(ask(client) for _ in range(FIRST_REQUESTS)))
            return own_s, sent_at, answers

    own_s, sent_at, answers = asyncio.run(scenario())
    handle = serve.get_deployment_handle("EngineReplica", APP_NAME)
    cold: ColdStart = handle.cold_start.remote().result(timeout_s=30)
    cold_start_s = cold.ready_at - sent_at
    first_s = min(seconds for seconds, _ in answers)
    print(f"from zero: first answer after {first_s:.1f}s; the replica was ready {cold_start_s:.1f}s after the "
          f"requests were sent (Serve's reaction and the worker process {cold.process_started_at - sent_at:.1f}s, "
          f"process start to ready {cold.ready_at - cold.process_started_at:.1f}s: replica construction "
          f"{cold.init_s:.1f}s, weights {cold.engine.weights_s:.1f}s, model {cold.engine.model_s:.1f}s, kernels "
          f"{cold.engine.kernels_s:.1f}s {'built' if cold.engine.kernels_built else 'from the build cache'}); "
          f"the request alone takes {own_s:.1f}s")
    assert [tokens for _, tokens in answers] == [24] * FIRST_REQUESTS, answers
    assert cold.process_started_at >= sent_at - 1.0, "the replica that answered was started for these requests"
    assert first_s <= cold_start_s + own_s + ROUTABLE_AFTER_READY_S, (first_s, cold_start_s, own_s)
