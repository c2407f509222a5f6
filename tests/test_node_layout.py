"""`make serve` lays out engine replicas for the node: one per GPU where there are GPUs, the CPU layout otherwise."""
from __future__ import annotations

from pathlib import Path

import yaml

from deployments.config import AppArgs
from deployments.node_layout import detect_gpus, layout_config, layout_target, main, nodes_config

ROOT = Path(__file__).resolve().parents[1]


def driver_dir(tmp_path: Path, count: int) -> Path:
    """The driver's /proc/driver/nvidia/gpus: one folder per GPU, named by its PCI address."""
    gpus = tmp_path / "gpus"
    for i in range(count):
        (gpus / f"0000:{i:02x}:00.0").mkdir(parents=True)
    return gpus


def test_gpus_are_counted_from_the_driver_and_narrowed_by_cuda_visible_devices(tmp_path):
    gpus = driver_dir(tmp_path, 4)
    assert detect_gpus({}, gpus) == 4
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": "1,3"}, gpus) == 2
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": ""}, gpus) == 0
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,2"}, gpus) == 1
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"}, gpus) == 4  # a listed id needs a device


def test_the_serve_config_gets_one_engine_replica_per_gpu_and_bounds_that_follow_the_count():
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    laid_out, message = layout_config(config, 4)
    assert "4 GPU(s)" in message
    (app,) = laid_out["applications"]
    args = AppArgs.model_validate(app["args"])
    assert args.engine_num_gpus == 1 and args.num_engine_replicas == 4
    assert args.engine_num_cpus == 1  # a GPU replica's step loop, whatever the CPU layout gives a replica
    assert args.autoscaling.enabled and (args.autoscaling.min_replicas, args.autoscaling.max_replicas) == (1, 4)
    assert args.engine_config().device == "cuda"
    assert laid_out["applications"][0]["args"]["engine"] == config["applications"][0]["args"]["engine"]


def test_without_gpus_or_with_a_pinned_layout_the_config_is_kept(tmp_path):
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    same, message = layout_config(config, 0)
    assert same is config and "CPU layout" in message
    assert AppArgs.model_validate(config["applications"][0]["args"]).engine_config().device == "cpu"
    pinned = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    pinned["applications"][0]["args"]["engine_num_gpus"] = 0
    assert layout_config(pinned, 8)[0] is pinned
    # What `make serve` hands `serve run`: the file itself on CPU, a rewritten copy for GPUs.
    target = str(ROOT / "serve_config.yaml")
    assert layout_target(target, [], 0, tmp_path)[0] == target
    path, _, _ = layout_target(target, [], 2, tmp_path)
    assert Path(path).parent == tmp_path
    assert yaml.safe_load(Path(path).read_text())["applications"][0]["args"]["num_engine_replicas"] == 2
    assert layout_target("deployments.app:build_app", ["dtype=float32"], 2, tmp_path)[1] == [
        "dtype=float32", "engine_num_gpus=1", "num_engine_replicas=2"]


def test_the_serve_config_on_this_machine_is_one_engine_replica_of_both_cpus():
    args = AppArgs.model_validate(yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"])
    assert (args.num_engine_replicas, args.engine_num_cpus, args.autoscaling.max_replicas) == (1, 2, 1)
    assert args.engine_config().num_threads == 2


def test_laid_out_for_cpu_nodes_one_engine_replica_per_node_of_its_cpus(capsys):
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    laid_out = nodes_config(config, nodes=2, cpus_per_node=1)
    args = AppArgs.model_validate(laid_out["applications"][0]["args"])
    assert (args.num_engine_replicas, args.engine_num_cpus) == (2, 1)
    assert (args.autoscaling.min_replicas, args.autoscaling.max_replicas) == (1, 2)
    assert args.engine_config().num_threads == 1
    assert config["applications"][0]["args"]["num_engine_replicas"] == 1  # the file read is left as it was
    main([str(ROOT / "serve_config.yaml"), "--nodes", "3", "--cpus-per-node", "4"])
    printed = AppArgs.model_validate(yaml.safe_load(capsys.readouterr().out)["applications"][0]["args"])
    assert (printed.num_engine_replicas, printed.engine_num_cpus, printed.autoscaling.max_replicas) == (3, 4, 3)
