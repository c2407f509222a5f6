"""The HTTP port is the ingress replica's own server (Serve's direct ingress), as `make serve` runs it, and Serve's
proxy in front of the same app answers too."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import openai
import pytest

from deployments.direct_ingress import direct_ingress_env, direct_ingress_refusal, share_port_with_predecessor
from deployments.local import free_port

APP = "deployments.app:build_app"


def test_direct_ingress_needs_one_app_of_one_ingress_replica():
    assert direct_ingress_refusal([(APP, {"ingress_max_replicas": 1})]) is None
    assert "ingress_max_replicas" in direct_ingress_refusal([(APP, {})])  # the default may scale to 2
    assert "2 applications" in direct_ingress_refusal([(APP, {"ingress_max_replicas": 1})] * 2)
    assert "not tokenline's app" in direct_ingress_refusal([("other.app:build", {})])
    assert "do not parse" in direct_ingress_refusal([(APP, {"ingress_max_replicas": "many"})])


def test_direct_ingress_takes_exactly_the_http_port():
    env = direct_ingress_env(8000)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    # Serve allocates from [min, max): the one port.
    assert (int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"]), int(env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"])) \
        == (8000, 8001)


def test_a_replacement_ingress_server_binds_the_port_beside_the_one_still_draining():
    """Serve's own server start, as an ingress replica calls it, twice on one port: the second binds (the
    replacement) while the first still listens, and a request reaches one of them."""
    import urllib.request

    from ray.serve._private import replica
    from ray.serve.config import HTTPOptions

    async def hello(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"hello"})

    async def run() -> bytes:
        share_port_with_predecessor()
        options = HTTPOptions(host="127.0.0.1", port=free_port())
        loop = asyncio.get_running_loop()
        servers = [await replica.start_asgi_http_server(hello, options, event_loop=loop) for _ in range(2)]
        try:
            for _ in range(500):  # uvicorn starts serving in its task
                if all(server.started for _, server in servers):
                    break
                await asyncio.sleep(0.01)
            url = f"http://127.0.0.1:{options.port}/"
            return await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
        finally:
            for task, server in servers:
                server.should_exit = True
                await asyncio.wait_for(task, 10)

    assert asyncio.run(run()) == b"hello"


def listener(port: int) -> tuple[int, str]:
    """The pid and command line of the process listening on 127.0.0.1:port, from /proc (Linux)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                inodes.add(fields[9])
    assert inodes, f"nothing listens on port {port}"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in {f"socket:[{i}]" for i in inodes} for fd in fds):
                return int(pid), Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone, or not ours to read
            continue
    raise AssertionError(f"no process found for the listener on port {port}")


@pytest.mark.slow
@pytest.mark.serve
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads listeners from Linux's /proc")
def test_the_ingress_replica_answers_the_api_port_itself_and_the_proxy_answers_beside_it(serve_app):
    port = int(serve_app.base_url.rsplit(":", 1)[1])
    proxy_port = int(serve_app.proxy_url.rsplit(":", 1)[1])
    assert port != proxy_port
    assert "OpenAIIngress" in listener(port)[1]  # Ray names the process after the replica
    assert "ProxyActor" in listener(proxy_port)[1]
    for url in (serve_app.base_url, serve_app.proxy_url):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            answer = client.chat.completions.create(model=serve_app.model, max_tokens=4, temperature=0,
                                                    messages=[{"role": "user", "content": "Say hello."}])
            assert answer.usage.completion_tokens == 4 and answer.choices[0].message.content


@pytest.mark.slow
@pytest.mark.serve
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads listeners from Linux's /proc")
def test_a_killed_ingress_replica_is_replaced_on_the_same_port(serve_app):
    """Serve replaces a dead ingress replica; its replacement takes the API port back (none is blocked)."""
    import time
    import urllib.request

    import ray

    from tests.serve_processes import INGRESS, replica_actors, replica_pids

    port = int(serve_app.base_url.rsplit(":", 1)[1])
    (old_id, old_pid), = replica_pids(INGRESS).items()
    ray.kill(replica_actors(INGRESS)[old_id], no_restart=True)
    deadline = time.monotonic() + 180
    pids: dict[str, int] = {}
    while time.monotonic() < deadline:
        pids = replica_pids(INGRESS)
        if pids and old_id not in pids:
            try:
                with urllib.request.urlopen(f"{serve_app.base_url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:  # the replacement is not serving yet
                pass
        time.sleep(1)
    else:
        raise AssertionError(f"no new ingress replica answered on port {port} within 180 s (replicas: {pids})")
    (new_pid,) = pids.values()
    assert new_pid != old_pid and listener(port)[0] == new_pid
    with openai.OpenAI(base_url=f"{serve_app.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        answer = client.completions.create(model=serve_app.model, prompt="Hello", max_tokens=3, temperature=0)
        assert answer.usage.completion_tokens == 3
