"""Shared fixtures: tiny random Llama-family checkpoints and the default model."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors. Triton reads this when it is first
# imported (its own library functions are defined then), so it is set before any test can import it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Tests marked `disruptive` (they kill, scale or redeploy the session's app) run last, these modules in this order
# and then any other in file order: first those that need the app as the session started it, then those that
# redeploy their own arguments over whatever the last one left (tests/serve_processes.py: as_started).
DISRUPTIVE_MODULES = ("test_serve_failures.py", "test_autoscaling_e2e.py", "test_serve_tensor_parallel.py")


def pytest_collection_modifyitems(config, items):
    def order(item) -> tuple[int, int]:
        if item.get_closest_marker("disruptive") is None:
            return (0, 0)
        name = item.path.name
        return (1, DISRUPTIVE_MODULES.index(name) if name in DISRUPTIVE_MODULES else len(DISRUPTIVE_MODULES))

    items.sort(key=order)


def default_model_path() -> Path:
    from engine.model_fetch import default_model_path as cached
    return Path(os.environ.get("TOKENLINE_MODEL") or cached())


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = default_model_path()
    if not path.exists():
        pytest.skip(f"default model not at {path}: run `make model` (make test does it)")
    return path


@pytest.fixture(scope="session")
def serve_app(smollm2_path: Path, tmp_path_factory):
    """The real app on a local Ray (2 engine replicas, SmolLM2 in bf16), started on first use, stopped at the end.

    Yields a LocalServe: `.base_url` (http://127.0.0.1:PORT), `.model` (the served name), `.metrics_url`,
    `.engine_replica_stats()` (each engine replica's own ReplicaStats) and `.scrape_metrics()`.
    """
    from deployments import local
    from deployments.config import AppArgs

    # No API keys: the API is open. API-key tests point the running ingress at key files of their own
    # (tests/serve_processes.py: configure_ingress_security) and back.
    # A KV pool smaller than the model's context, so the engine's own capacity check is reachable too.
    args = AppArgs(model=str(smollm2_path), num_engine_replicas=2, engine_num_cpus=1, num_kv_blocks=384,
                   ingress_max_replicas=1, profiler_dir=str(tmp_path_factory.mktemp("profiles")))
    # The dashboard too, for its Serve API (`.dashboard_json(path)`). The ingress replica answers HTTP itself, as
    # under `make serve`; Serve's proxy in front of the same app is `.proxy_url`.
    app = local.start(args, num_cpus=2, metrics_report_interval_ms=1000, dashboard_port=local.free_port(),
                      direct_ingress=True)
    app.started_args = args  # what tests/serve_processes.py: as_started puts back
    try:
        yield app
    finally:
        app.stop()
