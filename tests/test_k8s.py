"""The Kubernetes manifests in k8s/: each variant (overlay), rendered by kustomize, is a RayService that KubeRay's
CRD accepts, whose serveConfigV2 Ray Serve and our AppArgs accept, whose engine worker group holds exactly the
engine replicas that config asks for, watched by PodMonitors that select its pods, with a Grafana dashboard that
queries only metrics the app exports.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import yaml

from deployments.config import AppArgs

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
CRD = ROOT / "tests" / "fixtures" / "kuberay" / "ray.io_rayservices.yaml"  # KubeRay's, Apache-2.0
DASHBOARD = K8S / "base" / "grafana-dashboard.json"
VARIANTS = ["gpu", "gpu-tp2", "cpu"]
IMAGES = {"gpu": "gpu", "gpu-tp2": "gpu", "cpu": "cpu"}  # the image tag (and Dockerfile) of each variant
DOCKERFILES = {"gpu": ROOT / "Dockerfile.gpu", "cpu": ROOT / "Dockerfile"}
# The ports KubeRay looks for by name on the head container.
HEAD_PORTS = {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": 8000, "metrics": 8080}
# Resources and replica counts of the engine come from `args` alone; an override under `deployments:` would be a
# second source the worker groups could silently disagree with.
ENGINE_OPTIONS_FROM_ARGS = {"num_replicas", "autoscaling_config", "ray_actor_options", "placement_group_bundles",
                            "placement_group_strategy", "max_replicas_per_node", "request_router_config"}


def kustomize() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@cache
def _render(variant: str) -> tuple[dict, ...]:
    proc = subprocess.run([*kustomize(), str(K8S / "overlays" / variant)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"kustomize failed on k8s/overlays/{variant}:\n{proc.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def render(variant: str) -> tuple[dict, ...]:
    if kustomize() is None:
        pytest.skip("neither kustomize nor kubectl (which has it built in) is installed: the overlays of k8s/ "
                    "cannot be rendered")
    return _render(variant)


def one(docs: tuple[dict, ...], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def rayservice(variant: str) -> dict:
    return one(render(variant), "RayService")


def serve_config(variant: str):
    from ray.serve.schema import ServeDeploySchema

    return ServeDeploySchema.model_validate(yaml.safe_load(rayservice(variant)["spec"]["serveConfigV2"]))


def tokenline_app(variant: str):
    (app,) = [a for a in serve_config(variant).applications if a.import_path == "deployments.app:build_app"]
    return app


def engine_group(variant: str) -> dict:
    (group,) = rayservice(variant)["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return group


def ray_container(pod_spec: dict) -> dict:
    return pod_spec["containers"][0]  # KubeRay's rule when no container sets RAY=true


def cpu_count(quantity: str | int) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


# -- every file ------------------------------------------------------------------------------------------------

def test_every_yaml_in_k8s_parses_and_every_file_a_kustomization_names_exists():
    files = sorted(K8S.rglob("*.yaml"))
    assert files
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path} holds no document"
        if path.name != "kustomization.yaml":
            continue
        (kustomization,) = docs
        named = list(kustomization.get("resources", []))
        named += [p["path"] for p in kustomization.get("patches", []) if "path" in p]
        named += [f.split("=", 1)[-1] for g in kustomization.get("configMapGenerator", []) for f in g["files"]]
        for name in named:
            assert (path.parent / name).exists(), f"{path.relative_to(ROOT)} names {name}, which does not exist"


# -- each variant, rendered -------------------------------------------------------------------------------------

def strict(schema: dict) -> dict:
    """KubeRay's schema lets unknown fields through (the API server prunes them); here a misspelt one fails."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(out.get("items"), dict):
        out["items"] = strict(out["items"])
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = strict(out["additionalProperties"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [strict(s) for s in out[key]]
    return out


@pytest.fixture(scope="module")
def rayservice_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return {"group": crd["spec"]["group"], "kind": crd["spec"]["names"]["kind"],
            "schema": strict(v1["schema"]["openAPIV3Schema"])}


@pytest.mark.parametrize("variant", VARIANTS)
def test_rayservice_validates_against_kuberays_crd(variant, rayservice_schema):
    import jsonschema

    service = rayservice(variant)
    assert service["apiVersion"] == f"{rayservice_schema['group']}/v1"
    assert service["kind"] == rayservice_schema["kind"]
    errors = sorted(jsonschema.Draft4Validator(rayservice_schema["schema"]).iter_errors(service),
                    key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:10])


@pytest.mark.parametrize("variant", VARIANTS)
def test_serve_config_is_the_overlays_file_and_validates_with_serve_and_app_args(variant):
    text = rayservice(variant)["spec"]["serveConfigV2"]
    assert yaml.safe_load(text) == yaml.safe_load((K8S / "overlays" / variant / "serve_config.yaml").read_text())
    config = serve_config(variant)
    assert config.http_options.host == "0.0.0.0" and config.http_options.port == HEAD_PORTS["serve"]
    app = tokenline_app(variant)
    AppArgs.model_validate(app.args)
    names = {d.name for d in app.deployments}
    assert names <= {"EngineReplica", "OpenAIIngress"}, f"unknown deployments in serveConfigV2: {names}"
    for deployment in app.deployments:
        if deployment.name == "EngineReplica":
            overridden = deployment.model_fields_set & ENGINE_OPTIONS_FROM_ARGS
            assert not overridden, f"set {sorted(overridden)} through args, not under deployments:"


@dataclass
class EngineShape:
    """What Serve will ask of the cluster for the engine deployment (per replica: all its ranks' bundles)."""

    num_gpus: float
    num_cpus: float
    min_replicas: int
    max_replicas: int
    router: str  # the request router's import path
    bundles: list[dict[str, float]] | None = None  # the replica's placement group, one bundle per rank
    strategy: str | None = None


@cache
def engine_shape(variant: str, model: Path) -> EngineShape:
    """`model` stands in for the overlay's own (in the image, or on the cluster's volume): the builder checks it."""
    # Private: Serve has no public call that lists an application's deployments with their options before it runs.
    from ray.serve._private.build_app import build_app as build_graph  # what `serve deploy` builds from args

    from deployments.app import build_app

    app = tokenline_app(variant)
    built = build_graph(build_app(AppArgs.model_validate({**app.args, "model": str(model)})), name=app.name)
    (engine,) = [d for d in built.deployments if d.name == "EngineReplica"]
    options = engine.ray_actor_options
    autoscaling = engine._deployment_config.autoscaling_config
    low, high = ((autoscaling.min_replicas, autoscaling.max_replicas) if autoscaling
                 else (engine.num_replicas, engine.num_replicas))
    router = engine._deployment_config.request_router_config.request_router_class
    bundles = engine._replica_config.placement_group_bundles
    if bundles:  # the replica and its other ranks: one node must hold them all
        return EngineShape(sum(b.get("GPU", 0) for b in bundles), sum(b.get("CPU", 0) for b in bundles), low, high,
                           router, bundles, engine._replica_config.placement_group_strategy)
    return EngineShape(options.get("num_gpus") or 0, options.get("num_cpus") or 0, low, high, router)


@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_worker_group_holds_exactly_the_engine_replicas_serve_asks_for(variant, smollm2_path):
    engine = engine_shape(variant, smollm2_path)
    group = engine_group(variant)
    container = ray_container(group["template"]["spec"])
    requests, limits = container["resources"]["requests"], container["resources"]["limits"]
    pod_gpus = int(limits.get("nvidia.com/gpu", 0))
    assert int(requests.get("nvidia.com/gpu", 0)) == pod_gpus, "GPU requests and limits must be equal"
    pod_cpus = cpu_count(group["rayStartParams"].get("num-cpus", limits["cpu"]))
    if variant.startswith("gpu"):
        ranks = AppArgs.model_validate(tokenline_app(variant).args).engine_args().tensor_parallel_size
        assert engine.num_gpus == ranks and pod_gpus >= ranks, "one GPU per rank of an engine replica, on GPU pods"
    else:
        assert engine.num_gpus == 0 and pod_gpus == 0, "the CPU variant asks for no GPU"
    per_pod = [math.floor(pod_cpus / engine.num_cpus)] if engine.num_cpus else []
    if engine.num_gpus:
        per_pod.append(math.floor(pod_gpus / engine.num_gpus))
        assert pod_gpus % engine.num_gpus == 0, f"{pod_gpus} GPUs per pod strand part of one"
    replicas_per_pod = min(per_pod)
    assert replicas_per_pod >= 1, f"a worker pod ({pod_cpus} CPUs, {pod_gpus} GPUs) fits no engine replica"
    if engine.num_gpus:
        assert replicas_per_pod * engine.num_gpus == pod_gpus, "the pod's CPUs leave some of its GPUs idle"
    needed = math.ceil(engine.max_replicas / replicas_per_pod)
    assert group["maxReplicas"] == needed, (
        f"{engine.max_replicas} engine replicas at most, {replicas_per_pod} per pod: maxReplicas should be "
        f"{needed}, not {group['maxReplicas']}")
    assert group["minReplicas"] * replicas_per_pod <= engine.min_replicas, "minReplicas keeps idle pods"
    assert group["minReplicas"] <= group.get("replicas", 0) <= group["maxReplicas"]
    assert rayservice(variant)["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True


@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_requests_go_through_the_prefix_aware_router(variant, smollm2_path):
    assert engine_shape(variant, smollm2_path).router == "deployments.router.PrefixAwareRouter"


@pytest.mark.parametrize("variant", VARIANTS)
def test_head_has_no_accelerator_and_names_the_ports_kuberay_expects(variant):
    head = rayservice(variant)["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    container = ray_container(head["template"]["spec"])
    resources = container["resources"]
    assert "nvidia.com/gpu" not in resources.get("limits", {}) and "nvidia.com/gpu" not in resources.get("requests", {})
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == HEAD_PORTS
    assert head["rayStartParams"]["metrics-export-port"] == str(HEAD_PORTS["metrics"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_images_ray_version_and_baked_model_match_the_dockerfiles(variant):
    from engine.model_fetch import GGUF_NAME

    dockerfile = DOCKERFILES[IMAGES[variant]].read_text()
    ray_version = re.search(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.M).group(1)
    cluster = rayservice(variant)["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray_version, f"rayVersion differs from {DOCKERFILES[IMAGES[variant]].name}'s Ray"
    pods = [cluster["headGroupSpec"]["template"]["spec"], engine_group(variant)["template"]["spec"]]
    assert {c["image"] for pod in pods for c in pod["containers"]} == {f"tokenline:{IMAGES[variant]}"}
    assert re.search(r"^RUN pip install --no-cache-dir /opt/tokenline/src$", dockerfile, re.M), \
        "the image installs the project"
    if variant == "cpu":
        cache_dir = re.search(r"^ENV TOKENLINE_CACHE=(\S+)$", dockerfile, re.M).group(1)
        assert tokenline_app(variant).args["model"] == f"{cache_dir}/{GGUF_NAME}", "the model baked into the image"


def test_gpu_image_compiles_no_kernel_and_its_overlay_runs_triton_with_graphs_and_memory_sizing():
    dockerfile = DOCKERFILES["gpu"].read_text()
    assert "-f Dockerfile.gpu -t tokenline:gpu" in dockerfile, "the build command names the overlay's image"
    assert "--no-build-isolation" not in dockerfile, "a source build of flash-attn needs nvcc, absent in this image"
    for line in [l for l in dockerfile.splitlines() if re.search(r"flash.attn", l, re.I) and "pip install" in l]:
        assert "--only-binary=:all:" in line, f"flash-attn only from a prebuilt wheel: {line.strip()}"
    assert "import torch, triton" in dockerfile, "the build checks that torch brought Triton"
    engine = AppArgs.model_validate(tokenline_app("gpu").args).engine_config()
    assert engine.device == "cuda" and engine.attention_backend in ("auto", "triton") and not engine.enforce_eager
    assert engine.num_kv_blocks is None and 0.5 <= engine.gpu_memory_utilization <= 0.95
    assert engine_group("gpu")["template"]["spec"]["containers"][0]["image"] == "tokenline:gpu"


def test_tensor_parallel_variant_packs_each_replicas_ranks_onto_the_gpus_of_one_pod(smollm2_path):
    engine = engine_shape("gpu-tp2", smollm2_path)
    ranks = AppArgs.model_validate(tokenline_app("gpu-tp2").args).engine_args().tensor_parallel_size
    assert ranks == 2 and engine.strategy == "STRICT_PACK"
    assert engine.bundles == [{"CPU": engine.num_cpus / ranks, "GPU": 1}] * ranks, "one bundle of one GPU per rank"
    limits = ray_container(engine_group("gpu-tp2")["template"]["spec"])["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == ranks and cpu_count(limits["cpu"]) >= engine.num_cpus


@pytest.mark.parametrize("variant", VARIANTS)
def test_podmonitors_select_the_head_and_the_workers_by_their_metrics_port(variant):
    docs = render(variant)
    cluster = rayservice(variant)["spec"]["rayClusterConfig"]
    # KubeRay adds ray.io/node-type to every pod it creates from these templates.
    pods = {"head": (cluster["headGroupSpec"], "head"), "workers": (engine_group(variant), "worker")}
    selected = {}
    for monitor in [d for d in docs if d["kind"] == "PodMonitor"]:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        wanted = monitor["spec"]["selector"]["matchLabels"]
        for role, (group, node_type) in pods.items():
            labels = {**group["template"]["metadata"]["labels"], "ray.io/node-type": node_type}
            if wanted.items() <= labels.items():
                selected.setdefault(role, []).append(monitor["metadata"]["name"])
                container = ray_container(group["template"]["spec"])
                ports = {p["name"]: p["containerPort"] for p in container["ports"]}
                for endpoint in monitor["spec"]["podMetricsEndpoints"]:
                    assert ports.get(endpoint["port"]) == int(group["rayStartParams"]["metrics-export-port"])
    assert {role: len(names) for role, names in selected.items()} == {"head": 1, "workers": 1}, selected


@pytest.mark.parametrize("variant", VARIANTS)
def test_grafana_dashboard_ships_as_a_configmap_grafana_loads(variant):
    configmap = one(render(variant), "ConfigMap", "tokenline-grafana-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["tokenline.json"]) == json.loads(DASHBOARD.read_text())
    assert not [d for d in render(variant) if d["metadata"]["name"] == "tokenline-serve-config"], \
        "the serve config's ConfigMap is a kustomize input, not a resource to apply"


# -- the Grafana dashboard ----------------------------------------------------------------------------------------

def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    return [t["expr"] for p in panels for t in p["targets"]]


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(ray_[a-z0-9_]+)\b", expr))


def declared_tokenline_metrics() -> set[str]:
    """The names Ray exports for tokenline's own metrics: ray_ + name, counters with _total, histograms in parts."""
    from ray.util import metrics

    from deployments.engine_metrics import EngineMetrics
    from deployments.http_metrics import HttpMetricsMiddleware
    from deployments.timeline_recorder import StageMetrics

    sources = [EngineMetrics("model", "replica", 4096), HttpMetricsMiddleware(app=None), StageMetrics("model")]
    exported = set()
    for metric in [m for source in sources for m in vars(source).values() if isinstance(m, metrics.Metric)]:
        name = f"ray_{metric.info['name']}"
        if isinstance(metric, metrics.Counter):
            exported.add(f"{name}_total")
        elif isinstance(metric, metrics.Histogram):
            exported |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        else:
            exported.add(name)
    return exported


def test_dashboard_panels_are_well_formed_and_query_declared_tokenline_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] and dashboard["title"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "model_name"} <= variables
    for panel in [p for p in dashboard["panels"] if p["type"] != "row"]:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys()
    declared = declared_tokenline_metrics()
    used = set()
    for expr in dashboard_queries():
        for opening, closing in ("()", "{}", "[]"):
            assert expr.count(opening) == expr.count(closing), f"unbalanced {opening}{closing} in {expr}"
        names = metric_names(expr)
        assert names, f"no metric in {expr}"
        assert all(n.startswith(("ray_tokenline_", "ray_serve_")) for n in names), expr
        unknown = {n for n in names if n.startswith("ray_tokenline_")} - declared
        assert not unknown, f"{expr} uses {unknown}, which the app does not export"
        used |= names
    # What a serving dashboard must show: latencies, stage times, throughput, KV and prefix cache, queues, replicas.
    for needed in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
                   "request_prefill_time_seconds_bucket", "request_decode_time_seconds_bucket",
                   "generation_tokens_total", "kv_cache_usage_perc", "prefix_cache_hits_total",
                   "num_requests_waiting", "num_requests_running", "num_preemptions_total",
                   "request_stage_seconds_bucket", "request_stage_seconds_sum", "tenant_prompt_tokens_total",
                   "tenant_output_tokens_total", "tenant_cached_tokens_total", "tenant_requests_total"):
        assert f"ray_tokenline_{needed}" in used, f"the dashboard has no panel on ray_tokenline_{needed}"
    for needed in ("ray_serve_deployment_replica_healthy", "ray_serve_autoscaling_target_replicas"):
        assert needed in used, f"the dashboard has no panel on {needed}"


# Counters Ray exports only once they first count: no preemption happens in a short run on an idle app.
APPEAR_ON_EVENT = {"ray_tokenline_num_preemptions_total"}


@pytest.mark.slow
@pytest.mark.serve
def test_every_dashboard_metric_appears_in_a_scrape_of_the_running_app(serve_app):
    import time
    import urllib.request

    # Three requests on two replicas: one replica sees the prompt twice, so prefix-cache hits are counted too.
    body = json.dumps({"model": serve_app.model, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "Name three rivers of Europe, please."}]}).encode()
    for _ in range(3):
        request = urllib.request.Request(f"{serve_app.base_url}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200
    wanted = set().union(*map(metric_names, dashboard_queries())) - APPEAR_ON_EVENT
    # Ray stops exporting a gauge some 20 s after its last update, so a name seen in any scrape counts.
    deadline, seen = time.monotonic() + 60, set()
    while time.monotonic() < deadline and not wanted <= seen:
        seen |= set(re.findall(r"^(ray_[a-z0-9_]+)", serve_app.scrape_metrics(), re.M))
        time.sleep(1)
    assert wanted <= seen, f"dashboard metrics absent from the app's Prometheus export: {sorted(wanted - seen)}"
