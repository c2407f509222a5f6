"""Where engine replicas go on this node: one per GPU where there are GPUs, the config's CPU layout otherwise.

GPUs are counted the way the driver shows them (/proc/driver/nvidia/gpus, else `nvidia-smi -L`), narrowed by
CUDA_VISIBLE_DEVICES, without initialising CUDA in this process: Ray forks workers from it, and a CUDA context
must not be inherited (nor exist at all on a CPU machine).
"""
from __future__ import annotations

import copy
import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

APP_IMPORT_PATH = "deployments.app:build_app"
NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")


def detect_gpus(environ: Mapping[str, str] = os.environ, proc_dir: Path = NVIDIA_PROC) -> int:
    """NVIDIA GPUs this process may use: the driver's count, capped by CUDA_VISIBLE_DEVICES when it is set."""
    if proc_dir.is_dir():
        physical = sum(1 for _ in proc_dir.iterdir())
    else:
        physical = _nvidia_smi_count()
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return physical
    listed = [d for d in (part.strip() for part in visible.split(",")) if d]
    if "-1" in listed:  # CUDA stops at the first invalid id: "-1" hides every GPU after it
        listed = listed[:listed.index("-1")]
    return min(physical, len(listed))


def _nvidia_smi_count() -> int:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):  # no driver loaded, or it hung: no usable GPU
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def replicas_app_args(args: Mapping[str, Any], count: int, **resources: int) -> dict[str, Any]:
    """AppArgs (as a dict) with `count` engine replicas of these resources (engine_num_cpus=..., engine_num_gpus=...),
    and engine autoscaling bounded by that count."""
    out = copy.deepcopy(dict(args))
    out.update(resources, num_engine_replicas=count)
    autoscaling = out.get("autoscaling")
    if isinstance(autoscaling, dict):
        autoscaling["max_replicas"] = count
        autoscaling["min_replicas"] = min(autoscaling.get("min_replicas", 1), count)
    return out


def gpu_app_args(args: Mapping[str, Any], num_gpus: int) -> dict[str, Any]:
    """AppArgs (as a dict) with one engine replica per GPU, and engine autoscaling bounded by the GPU count. A GPU
    replica's step loop gets one CPU, whatever the CPU layout gave a replica."""
    return replicas_app_args(args, num_gpus, engine_num_gpus=1, engine_num_cpus=1)


def layout_config(config: dict[str, Any], num_gpus: int) -> tuple[dict[str, Any], str]:
    """A Serve config laid out for this node, and one line saying which layout it is.

    A config that sets `engine_num_gpus` itself is left as it is."""
    apps = [a for a in config.get("applications", []) if a.get("import_path") == APP_IMPORT_PATH]
    if not apps:
        return config, f"no {APP_IMPORT_PATH} application in the config: left as it is"
    if any("engine_num_gpus" in a.get("args", {}) for a in apps):
        return config, "the config sets engine_num_gpus itself: its layout is kept"
    if num_gpus == 0:
        return config, "no GPU found: the CPU layout (engine replicas on CPU slices, as the config says)"
    out = copy.deepcopy(config)
    for app in out["applications"]:
        if app.get("import_path") == APP_IMPORT_PATH:
            app["args"] = gpu_app_args(app.get("args", {}), num_gpus)
    return out, f"{num_gpus} GPU(s) found: {num_gpus} engine replica(s), one GPU each (autoscaling up to {num_gpus})"


def nodes_config(config: dict[str, Any], nodes: int, cpus_per_node: int) -> dict[str, Any]:
    """A Serve config laid out for `nodes` CPU nodes of `cpus_per_node` CPUs: one engine replica on each node's CPUs
    (autoscaling up to one per node), as `make multinode` deploys it."""
    out = copy.deepcopy(config)
    for app in out.get("applications", []):
        if app.get("import_path") == APP_IMPORT_PATH:
            app["args"] = replicas_app_args(app.get("args", {}), nodes, engine_num_cpus=cpus_per_node)
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse
    parser = argparse.ArgumentParser(description="Prints a Serve config laid out for CPU nodes (nodes_config).")
    parser.add_argument("config")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--cpus-per-node", type=int, required=True)
    args = parser.parse_args(argv)
    config = yaml.safe_load(Path(args.config).read_text())
    print(yaml.safe_dump(nodes_config(config, args.nodes, args.cpus_per_node), sort_keys=False), end="")


def layout_target(target: str, app_args: list[str], num_gpus: int, workdir: Path) -> tuple[str, list[str], str]:
    """What `serve run` gets: a config file (rewritten into workdir for GPUs) or an import path with k=v args."""
    if target.endswith((".yaml", ".yml")):
        config = yaml.safe_load(Path(target).read_text())
        laid_out, message = layout_config(config, num_gpus)
        if laid_out is config:
            return target, app_args, message
        path = workdir / Path(target).name
        path.write_text(yaml.safe_dump(laid_out, sort_keys=False))
        return str(path), app_args, message
    given = {a.split("=", 1)[0] for a in app_args}
    if "engine_num_gpus" in given:
        return target, app_args, "engine_num_gpus given: that layout is kept"
    if num_gpus == 0:
        return target, app_args, "no GPU found: engine replicas on CPU"
    extra = ["engine_num_gpus=1"] + ([] if "num_engine_replicas" in given else [f"num_engine_replicas={num_gpus}"])
    return target, app_args + extra, f"{num_gpus} GPU(s) found: one engine replica per GPU"


if __name__ == "__main__":
    main()
