"""The app's typed arguments: the same schema for `serve run deployments.app:build_app k=v`, the YAML and Python."""
from __future__ import annotations

import dataclasses
import math
import re
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, create_model

from deployments.auth import SecurityArgs
from deployments.autoscaling_config import AutoscalingArgs, profile_budget_beside_decodes
from deployments.limits import LimitsArgs
from deployments.router_config import RouterArgs, RouterSettings
from deployments.timeline_config import TimelineArgs
from engine.config import EngineConfig

# llama.cpp's quantisation names (Q4_1, Q4_K_M, Q8_0, IQ2_XXS, TQ1_0, F16, BF16, FP32, MXFP4) at the end of a file
# name, after a '.' or '-': `Llama-3.1-8B-Instruct.Q4_K_M.gguf` is served as `Llama-3.1-8B-Instruct`.
QUANT_TAG = re.compile(r"[.-](?:[IT]?Q\d+(?:_[A-Z0-9]+)*|B?FP?(?:16|32)|MXFP4)$", re.IGNORECASE)


def served_name(model_path: str | Path) -> str:
    """A GGUF file's name without `.gguf` and a trailing quantisation tag; a folder's own name."""
    path = Path(model_path)
    if path.suffix != ".gguf":
        return path.name
    return QUANT_TAG.sub("", path.stem) or path.stem


# EngineConfig's fields that a deployment never sets by hand: AppArgs.engine_config derives them.
DERIVED_ENGINE_FIELDS = frozenset({"model", "device", "step_history", "record_request_events", "extra"})
# What the border adds to EngineConfig's own fields (their defaults live there): narrower types, bounds, help.
_BORDER_TYPES: dict[str, Any] = {"dtype": Literal["bfloat16", "float32", "float16"],
                                 "attention_backend": Literal["auto", "torch", "cpu", "triton", "flash-attn"],
                                 "quantization": Literal["int8"] | None}
_BORDER_FIELDS: dict[str, dict[str, Any]] = {
    # A served engine bounds its queue by default; an engine used alone does not.
    "max_num_waiting": dict(default=256, ge=0, description="requests queued in the engine, not running yet; past it "
                                                           "new ones get 503 (None: no bound)"),
    "gpu_memory_utilization": dict(gt=0, le=1, description="GPU only: share of the GPU's memory for weights, "
                                                           "activations and the KV pool (sizes the pool)"),
    "enforce_eager": dict(description="GPU only: no CUDA graphs for decode steps"),
    "tensor_parallel_size": dict(ge=1, description="ranks (devices) one engine replica spans; each rank gets "
                                                   "engine_num_cpus / engine_num_gpus of its own, all on one node"),
    "collective_timeout_s": dict(gt=0, description="tensor parallelism: how long a rank waits on the others in a "
                                                   "collective before the replica gives up"),
    "shm_collectives": dict(description="tensor parallelism on CPU: all-reduces through shared memory (native "
                                        "kernel), not gloo"),
    "attention_query_tiles": dict(description="CPU bf16: prompt rows attend in query tiles (faster); false: every "
                                              "row alone, for tokens that do not depend on how steps were composed"),
    "huge_pages": dict(description="CPU: weights and KV cache rebuilt on 2 MiB transparent huge pages after "
                                   "loading, where the kernel allows it (Linux 6.1+)"),
    "num_threads": dict(description="torch threads; default: the CPUs the replica was given"),
    "quantization": dict(description="CPU: int8 weights beside the bf16 ones for steps of up to 8 rows with "
                                     "AVX512-VNNI, 32 with AVX2 (half the bytes per decode step, an accuracy cost: "
                                     "README); unset: bf16 weights only"),
    "prefill_threads": dict(ge=1, description="CPU: torch threads for a step with a long prefill while the "
                                              "process's other CPUs sit idle (None: num_threads always)"),
    "max_tokens_with_decodes": dict(ge=1, description="token budget of a step that carries decodes (None: "
                                                      "max_num_batched_tokens; under autoscaling.policy slo: the "
                                                      "budget its replica profile was recorded with)"),
    "decode_threads": dict(ge=1, description="CPU: torch threads for every other step (decodes) while the "
                                             "process's other CPUs sit idle (None: num_threads always)"),
    "fair_share_prompt_weight": dict(ge=0, description="what a computed prompt token costs a tenant in the "
                                                       "fair-share counters"),
    "fair_share_output_weight": dict(ge=0, description="what an output token costs a tenant"),
}


def _engine_args_fields() -> dict[str, Any]:
    """EngineConfig's settable fields as pydantic fields, each default read from the dataclass."""
    hints = typing.get_type_hints(EngineConfig)
    fields = {}
    for f in dataclasses.fields(EngineConfig):
        if f.name not in DERIVED_ENGINE_FIELDS:
            border = {"default": f.default, **_BORDER_FIELDS.get(f.name, {})}
            fields[f.name] = (_BORDER_TYPES.get(f.name, hints[f.name]), Field(**border))
    return fields


EngineArgs = create_model("EngineArgs", __config__=ConfigDict(extra="forbid"), __module__=__name__,
                          __doc__="Engine knobs, named as in EngineConfig; unset ones take the engine's defaults.",
                          **_engine_args_fields())

# Engine knobs AppArgs also takes flat (`serve run ... dtype=float32`); set, they override `engine`.
FLAT_ENGINE_FIELDS = ("dtype", "num_kv_blocks", "max_num_seqs", "max_model_len")
_FlatEngineArgs = create_model(
    "_FlatEngineArgs", __config__=ConfigDict(extra="forbid"), __module__=__name__,
    **{name: (EngineArgs.model_fields[name].annotation | None, None) for name in FLAT_ENGINE_FIELDS})


class AppArgs(_FlatEngineArgs):
    """Everything `build_app` needs. Flat engine fields override `engine` so `serve run ... dtype=float32` works."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = Field(None, description="GGUF file or HF folder; default: the fetched SmolLM2 GGUF")
    served_model_name: str | None = Field(None, description="name clients send as `model`; default: the file "
                                                            "name without .gguf and a quantisation tag")
    num_engine_replicas: int = Field(2, ge=1)
    engine_num_cpus: float = Field(1.0, ge=0)
    engine_num_gpus: float = Field(0.0, ge=0)
    engine_max_ongoing_requests: int = Field(256, ge=1)
    ingress_num_cpus: float = Field(0.0, ge=0)
    ingress_min_replicas: int = Field(1, ge=1)
    ingress_max_replicas: int = Field(2, ge=1)
    ingress_target_ongoing_requests: float = Field(64, gt=0)
    ingress_max_ongoing_requests: int = Field(512, ge=1)
    # Seconds an engine replica waits after sending a chunk before sending the next: 0 sends one per engine step.
    stream_interval_s: float = Field(0.0, ge=0, le=1.0)
    # ... only while the replica streams more than this many requests (0: always): under load, fewer and larger
    # chunks cost the ingress and the client less CPU, which the engine shares; a few streams keep a chunk a step.
    stream_interval_min_streams: int = Field(0, ge=0)
    # Engine replicas send a request's chunks after the first over one connection per ingress replica, all of an
    # engine step's chunks for that ingress in one message (deployments/token_channel.py); false: one Serve
    # streaming item per chunk.
    token_channel: bool = True
    stats_interval_s: float = Field(1.0, gt=0)
    engine: EngineArgs = Field(default_factory=EngineArgs)
    router: RouterArgs = Field(default_factory=RouterArgs)
    autoscaling: AutoscalingArgs = Field(default_factory=AutoscalingArgs)
    security: SecurityArgs = Field(default_factory=SecurityArgs)
    timeline: TimelineArgs = Field(default_factory=TimelineArgs)
    profiler_dir: str | None = Field(None, description="engine replicas write torch profiler traces here "
                                                       "(POST /start_profile, /stop_profile); None: profiling is off")
    limits: LimitsArgs = Field(default_factory=LimitsArgs)

    def model_path(self) -> str:
        if self.model:
            return str(Path(self.model).expanduser())
        from engine.model_fetch import default_model_path
        return str(default_model_path())

    def model_name(self) -> str:
        return self.served_model_name or served_name(self.model_path())

    def engine_args(self) -> EngineArgs:
        overrides = {name: getattr(self, name) for name in FLAT_ENGINE_FIELDS if getattr(self, name) is not None}
        return self.engine.model_copy(update=overrides)

    def router_settings(self) -> RouterSettings:
        from engine.attention import effective_block_size

        args = self.engine_args()
        return RouterSettings(**self.router.model_dump(),
                              block_size=effective_block_size(args.attention_backend, args.block_size))

    def engine_config(self) -> EngineConfig:
        args = self.engine_args()
        device = "cuda" if self.engine_num_gpus > 0 else "cpu"
        # torch's intra-op pool matches the CPUs Ray reserved for the replica, never the whole machine.
        threads = args.num_threads or max(1, math.ceil(self.engine_num_cpus))
        # Off, the step ring keeps the engine's default length: the metrics read it either way.
        trace = {"step_history": self.timeline.step_ring} if self.timeline.enabled else {}
        fields = args.model_dump(exclude={"num_threads"})
        scaling = self.autoscaling
        if scaling.enabled and scaling.policy == "slo":
            if fields["ttft_objective_s"] is None:
                fields["ttft_objective_s"] = scaling.slo.ttft_s  # the SLO stated once: its engines schedule for it too
            if fields["max_tokens_with_decodes"] is None:
                # The policy's capacity model plans with the steps its profile was measured on: a step beside
                # running streams as long as the profile's, whatever the app's default for throughput.
                fields["max_tokens_with_decodes"] = profile_budget_beside_decodes(scaling.slo.profile)
        return EngineConfig(model=self.model_path(), device=device, **fields, num_threads=threads,
                            record_request_events=self.timeline.enabled, **trace)
