"""A two-node Ray cluster on this machine (a head and a worker, each its own `ray start`), the app deployed to it
with `serve deploy serve_config.yaml` laid out for two one-CPU nodes, one engine replica on each, answering the
OpenAI API.

The cluster is this test's own: its own temp dir, ports and auth token, apart from the session's `serve_app` Ray
(which lives in the pytest process). It is never stopped with `ray stop`, which ends every Ray on the machine:
each node runs as `ray start --block`, whose SIGTERM stops the processes that node started, and any process of
the cluster still alive after that is killed by id. Each node offers Ray one CPU, so the two engine replicas take
this machine's two cores, as the session's app does; that app sits idle meanwhile (pytest runs one test at a time).
"""
from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml

from deployments.config import AppArgs
from deployments.local import free_ports
from deployments.node_layout import nodes_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
NODE_LABEL = "tokenline.io/node"
START_TIMEOUT_S = 90.0
DEPLOY_TIMEOUT_S = 240.0
PR_SET_PDEATHSIG = 1


def end_with_parent() -> None:
    """In the child before exec: SIGTERM when pytest dies, so even a killed test run leaves no Ray behind."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class RayNode:
    name: str  # the value of its tokenline.io/node label
    process: subprocess.Popen
    log: Path


class TwoNodeCluster:
    """A Ray head and one worker on this machine, one CPU each (so one engine replica fits on each), labelled
    tokenline.io/node=head|worker, each started with `ray start --block`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        token_path = root / "auth_token"
        self.token = secrets.token_hex(32)
        token_path.write_text(self.token)
        token_path.chmod(0o600)
        # Ray 2.5x turns token auth on for a head when a token exists; the worker and CLIs need it said explicitly.
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path), RAY_USAGE_STATS_ENABLED="0")
        self.nodes: list[RayNode] = []
        gcs, dashboard, client, http, *node_ports = free_ports(4 + 2 * 4)
        self.gcs_port, self.dashboard_port, self.client_port, self.http_port = gcs, dashboard, client, http
        self.dashboard_url = f"http://127.0.0.1:{dashboard}"
        self._node_ports = [node_ports[:4], node_ports[4:]]

    def start(self) -> None:
        self._start_node("head", ["--head", "--port", str(self.gcs_port), "--dashboard-host", "127.0.0.1",
                                  "--dashboard-port", str(self.dashboard_port),
                                  "--ray-client-server-port", str(self.client_port)])
        (head,) = self.wait_for_nodes(1)
        # `ray start` gives a node the machine's address (even when told 127.0.0.1): the GCS is found there.
        self._start_node("worker", ["--address", f"{head['node_ip']}:{self.gcs_port}"])
        self.wait_for_nodes(2)

    def _start_node(self, name: str, role_args: list[str]) -> None:
        metrics, agent_http, agent_grpc, runtime_env = self._node_ports[len(self.nodes)]
        log = self.root / f"ray-start-{name}.log"
        cmd = [str(BIN / "ray"), "start", "--block", *role_args, "--temp-dir", str(self.root),
               "--num-cpus", "1", "--num-gpus", "0", "--labels", f"{NODE_LABEL}={name}",
               "--object-store-memory", str(100 << 20),
               "--metrics-export-port", str(metrics), "--dashboard-agent-listen-port", str(agent_http),
               "--dashboard-agent-grpc-port", str(agent_grpc), "--runtime-env-agent-port", str(runtime_env),
               "--min-worker-port", "0", "--max-worker-port", "0", "--disable-usage-stats"]
        with open(log, "wb") as out:
            process = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True, preexec_fn=end_with_parent)
        self.nodes.append(RayNode(name, process, log))

    def get(self, path: str, timeout_s: float = 10.0) -> dict:
        request = urllib.request.Request(f"{self.dashboard_url}{path}",
                                         headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())

    def alive_nodes(self) -> list[dict]:
        reply = self.get("/api/v0/nodes?detail=1&limit=100")
        return [n for n in reply["data"]["result"]["result"] if n["state"] == "ALIVE"]

    def wait_for_nodes(self, count: int) -> list[dict]:
        deadline = time.monotonic() + START_TIMEOUT_S
        last: object = None
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.process.poll() is not None:
                    raise RuntimeError(f"`ray start` of the {node.name} exited with {node.process.returncode}:\n"
                                       f"{node.log.read_text()[-3000:]}")
            try:
                last = self.alive_nodes()
                if len(last) == count:
                    return last
            except OSError as exc:  # the dashboard is not up yet
                last = exc
            time.sleep(1)
        raise TimeoutError(f"{count} Ray nodes did not come up within {START_TIMEOUT_S:.0f}s: {last!r}")

    def processes(self) -> list[psutil.Process]:
        """Every process of this cluster: the `ray start` of each node and all it has spawned."""
        found = []
        for node in self.nodes:
            try:
                parent = psutil.Process(node.process.pid)
                found += [parent, *parent.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        return found

    def stop(self, timeout_s: float = 60.0) -> list[psutil.Process]:
        """Serve shut down, then SIGTERM to each node's `ray start`, then a kill of whatever of the cluster is left.

        Returns what had to be killed.
        """
        if self.nodes:
            # Replicas the controller stops exit at once; replicas orphaned by their raylet linger for ~30 s.
            subprocess.run([str(BIN / "serve"), "shutdown", "--yes", "--address", self.dashboard_url], cwd=ROOT,
                           env=self.env, capture_output=True, timeout=60)
        processes = self.processes()
        for node in reversed(self.nodes):
            if node.process.poll() is None:
                node.process.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(processes, timeout=timeout_s)
        for process in alive:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                continue
        psutil.wait_procs(alive, timeout=10)
        for node in self.nodes:
            node.process.wait(timeout=10)
        return alive


def multinode_serve_config(model: Path, http_port: int, out: Path) -> Path:
    """serve_config.yaml laid out for two one-CPU nodes as `make multinode` lays it out (one engine replica on
    each), pointed at the test's model, a free port and a small KV pool."""
    config = nodes_config(yaml.safe_load((ROOT / "serve_config.yaml").read_text()), nodes=2, cpus_per_node=1)
    config["http_options"]["port"] = http_port
    app = config["applications"][0]
    app["args"].update(model=str(model), num_kv_blocks=128)
    AppArgs.model_validate(app["args"])
    out.write_text(yaml.safe_dump(config))
    return out


@pytest.fixture(scope="module")
def cluster(smollm2_path):
    # Short: Ray's unix socket paths live under it and must stay under 108 bytes.
    root = Path(tempfile.mkdtemp(prefix="tl-2node-", dir="/tmp"))
    nodes = TwoNodeCluster(root)
    try:
        nodes.start()
        yield nodes
    finally:
        killed = nodes.stop()
        # Ray's own processes name the temp dir in their command line; none may outlive the test.
        leftover = [p for p in psutil.process_iter(["cmdline"]) if str(root) in " ".join(p.info["cmdline"] or [])]
        shutil.rmtree(root, ignore_errors=True)
        assert not leftover, f"processes of the two-node cluster still running: {leftover}"
        assert not killed, f"the cluster did not stop on SIGTERM; these were killed: {killed}"


def test_serve_deploy_spreads_engine_replicas_over_head_and_worker_and_answers_chat(cluster, smollm2_path, tmp_path):
    config = multinode_serve_config(smollm2_path, cluster.http_port, tmp_path / "serve_config.yaml")
    deploy = subprocess.run([str(BIN / "serve"), "deploy", str(config), "--address", cluster.dashboard_url],
                            cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=120)
    assert deploy.returncode == 0, f"serve deploy failed:\n{deploy.stdout[-3000:]}\n{deploy.stderr[-3000:]}"

    deadline = time.monotonic() + DEPLOY_TIMEOUT_S
    status, replicas = "NOT_STARTED", []
    while time.monotonic() < deadline:
        app = cluster.get("/api/serve/applications/")["applications"].get("tokenline")
        if app is not None:
            status = app["status"]
            replicas = app["deployments"].get("EngineReplica", {}).get("replicas", [])
            if status == "RUNNING" and sum(r["state"] == "RUNNING" for r in replicas) == 2:
                break
            assert status != "DEPLOY_FAILED", app
        time.sleep(2)
    assert status == "RUNNING", f"the app is {status} after {DEPLOY_TIMEOUT_S:.0f}s: {replicas}"

    node_label = {n["node_id"]: n["labels"].get(NODE_LABEL) for n in cluster.alive_nodes()}
    running = [r for r in replicas if r["state"] == "RUNNING"]
    assert sorted(node_label[r["node_id"]] for r in running) == ["head", "worker"], running

    body = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 16, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{cluster.http_port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.loads(response.read())
    assert answer["choices"][0]["message"]["content"].strip()
    assert 0 < answer["usage"]["completion_tokens"] <= 16
