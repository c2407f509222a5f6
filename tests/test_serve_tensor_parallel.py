"""An engine replica over two tensor-parallel ranks (one CPU each, placed by Serve in one placement group): it
answers chat completions, and killing its second rank's actor makes Serve replace the whole replica."""
from __future__ import annotations

import time

import openai
import pytest

from deployments.tp_ranks import RANK_ACTOR_PREFIX
from tests.serve_processes import wait_for_replicas

pytestmark = [pytest.mark.slow, pytest.mark.serve, pytest.mark.disruptive]


def rank_actors() -> dict[str, str]:
    """Live rank actors: name -> namespace."""
    import ray

    return {a["name"]: a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(RANK_ACTOR_PREFIX)}


@pytest.fixture(scope="module")
def tp_app(serve_app):
    """The session's app redeployed as one replica of two ranks, over whatever the last disruptive test left; it
    stays so (tests/conftest.py runs this module last; tests/serve_processes.py: as_started puts it back)."""
    started = serve_app.started_args
    engine = started.engine.model_copy(update={"tensor_parallel_size": 2})
    serve_app.redeploy(started.model_copy(update={"num_engine_replicas": 1, "engine_num_cpus": 1, "engine": engine}))
    wait_for_replicas(serve_app, 1, timeout_s=240)
    return serve_app


def ask(app, timeout_s: float = 60) -> str:
    client = openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", timeout=timeout_s, max_retries=0)
    response = client.chat.completions.create(model=app.model, messages=[{"role": "user", "content": "Say hello."}],
                                              max_tokens=8, temperature=0)
    assert response.choices[0].finish_reason in ("stop", "length")
    assert response.usage.completion_tokens > 0
    return response.choices[0].message.content


def test_a_two_rank_replica_answers_and_a_killed_rank_gets_it_replaced(tp_app):
    import ray

    first = ask(tp_app)
    assert first
    ranks = rank_actors()
    assert len(ranks) == 1, ranks  # one replica, its second rank
    (name, namespace), = ranks.items()
    [before] = [s.replica_id for s in wait_for_replicas(tp_app, 1, timeout_s=30)]
    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)

    wait_for_replicas(tp_app, 1, timeout_s=240, without={before})
    deadline = time.monotonic() + 120
    while True:  # the new replica's rank is up with it; the proxy may still route to the old one for a moment
        try:
            assert ask(tp_app) == first  # greedy: the replaced replica gives the same answer
            break
        except (openai.APIStatusError, openai.APIConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    assert set(rank_actors()) - {name}, "the replacement replica has a rank of its own"
