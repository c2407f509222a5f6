"""Typed configuration: the model's shape (ModelArgs) and the engine's knobs (EngineConfig)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
           "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; use one of {sorted(set(_DTYPES))}")
    return _DTYPES[name]


@dataclass(frozen=True)
class ModelArgs:
    """The shape of a Llama-family decoder, read from a HF config or GGUF metadata."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelArgs":
        model_type = getattr(config, "model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"model type {model_type!r} is not supported; "
                             f"tokenline runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        rope = _rope_parameters(config)
        eos = config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            architecture=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(config, "attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
            bos_token_id=getattr(config, "bos_token_id", None),
            eos_token_ids=eos_ids,
        )


def _rope_parameters(config: Any) -> dict[str, Any]:
    """RoPE settings across transformers versions (`rope_parameters` in v5, `rope_scaling` before)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    return params


def default_num_threads() -> int:
    """CPUs this process may use (cgroup/affinity aware), which is what torch's intra-op pool should match."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


QUANTIZATIONS = ("int8",)  # weight-only, CPU (engine.models.layers.quantize_int8)


@dataclass
class EngineConfig:
    """Everything an engine replica needs to start. Sizes are in tokens unless named otherwise."""

    model: str
    dtype: str = "bfloat16"
    device: str = "cpu"
    block_size: int = 16
    # KV pool: an explicit block count wins; otherwise the pool is sized from this memory budget.
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    max_num_batched_tokens: int = 2048
    # The token budget of a step that carries decodes (None: max_num_batched_tokens): prompt chunks beside running
    # streams stay small, so no stream waits a long step for its next token; a prompt arriving at an idle engine
    # still takes the whole budget.
    max_tokens_with_decodes: int | None = None
    max_num_seqs: int = 64
    # Requests accepted but not yet running; past it AsyncEngine refuses new ones (None: no bound).
    max_num_waiting: int | None = None
    # The time-to-first-token objective the scheduler orders the queue for: a request still waiting half of it after
    # it arrived, with no first token, can no longer count on meeting it and yields its place to waiting requests that
    # can (engine.tenancy.WaitingQueue; engine.scheduler.LATE_SHARE). Overload then costs the requests beyond the
    # replica's capacity instead of every request queued behind them. None: arrival order alone, as vLLM schedules.
    # With `autoscaling.policy: slo` the app sets it to the SLO's TTFT.
    ttft_objective_s: float | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    # CUDA: the share of the GPU's memory this engine may fill (weights, a profiled peak step, then the KV pool),
    # as vLLM sizes it; it sizes the pool instead of kv_cache_memory_bytes unless num_kv_blocks is set.
    gpu_memory_utilization: float = 0.9
    # CUDA: decode steps replay CUDA graphs captured per batch bucket; True runs every step eagerly.
    enforce_eager: bool = False
    # Prepacked linear weights on CPU. bf16: the native kernel (AVX512-BF16, or AVX2 and FMA), else oneDNN's, else
    # F.linear; fp32: oneDNN's, else F.linear. False: F.linear (torch's own matmul) in every dtype.
    prepack_weights: bool = True
    # CPU, native kernel: steps of at most this many tokens run it; larger ones run oneDNN's prepacked kernel (AMX
    # tiles where the CPU has them: 1.6x the native kernel's tiles at 256 rows on a Xeon with AMX, 6-10x its dot
    # products at 64+), holding a second copy of the linear weights. None: where the CPU has AMX 80 (the native
    # kernel on its own AMX tiles) or 6 (a build without them), else the native kernel at every size
    # (engine.models.layers.default_native_max_rows). max_num_batched_tokens or more: the native kernel alone, and a
    # request's tokens the same bits whatever its neighbours and the prefix cache.
    native_linear_max_rows: int | None = None
    # CPU bf16 with packed keys: a prompt chunk's rows (8 or more of one sequence) attend in query tiles, 16 query
    # heads to a register (1.6-1.9x the row-by-row kernel's rate on Zen 5), or by SDPA where the CPU has AMX. False:
    # every row alone, as a decode is, so that a row's bits do not depend on how its prompt was chunked or read
    # from the prefix cache (with native_linear_max_rows >= max_num_batched_tokens: batch-invariant bf16 answers).
    attention_query_tiles: bool = True
    # CPU: "int8" also holds the linears' weights as int8 (one scale per output row) for steps of up to 8 rows
    # (AVX512-VNNI) or 32 (AVX2): half the bytes a decode step reads, at an accuracy cost (README). None: bf16
    # weights only.
    quantization: str | None = None
    # CPU: after loading, the weights' and KV cache's memory is rebuilt on 2 MiB transparent huge pages where the
    # kernel allows it (engine.huge_pages; Linux 6.1+, THP not "never"): fewer page-table walks a step.
    huge_pages: bool = True
    # CPU, native kernel: the packed linear weights live in one file in shared memory that every engine replica of
    # the model on the node maps (engine.shared_weights): one copy in RAM instead of one a replica. False: each
    # engine keeps its own copy.
    share_weights: bool = True
    # Where that file lives; None: /dev/shm where it is writable (else each engine keeps its own copy).
    shared_weights_dir: str | None = None
    num_threads: int | None = None
    # CPU: torch threads for a step with a long prefill while this process's other CPUs sit idle (engine.idle_cpus);
    # None: num_threads for every step.
    prefill_threads: int | None = None
    # CPU: torch threads for every other step (decodes, short prompts) while this process's other CPUs sit idle
    # (engine.idle_cpus); None: num_threads for them.
    decode_threads: int | None = None
    # Devices (ranks) one engine spans: Megatron-style tensor parallelism, rank 0 in this process.
    tensor_parallel_size: int = 1
    # Tensor parallelism: how long a rank waits on the others in a collective before the engine gives up.
    collective_timeout_s: float = 60.0
    # CPU tensor parallelism: all-reduces and the logits gather through shared memory (native kernel), not gloo.
    shm_collectives: bool = True
    seed: int = 0
    step_history: int = 512  # recent SchedulerStats kept (metrics read them; the step trace shows them)
    record_request_events: bool = True  # each request's lifecycle events (RequestTimings.events)
    # Fair share between tenants (engine.tenancy): what one computed prompt token and one output token cost.
    fair_share_prompt_weight: float = 1.0
    fair_share_output_weight: float = 2.0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two; got {self.block_size}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.max_tokens_with_decodes is not None and self.max_tokens_with_decodes < 1:
            raise ValueError(f"max_tokens_with_decodes must be >= 1 or None; got {self.max_tokens_with_decodes}")
        if self.native_linear_max_rows is not None and self.native_linear_max_rows < 0:
            raise ValueError(f"native_linear_max_rows must be >= 0 or None; got {self.native_linear_max_rows}")
        if self.max_num_waiting is not None and self.max_num_waiting < 0:
            raise ValueError(f"max_num_waiting must be >= 0 or None; got {self.max_num_waiting}")
        if self.ttft_objective_s is not None and not self.ttft_objective_s > 0:
            raise ValueError(f"ttft_objective_s must be > 0 or None; got {self.ttft_objective_s}")
        if self.tensor_parallel_size < 1 or self.collective_timeout_s <= 0:
            raise ValueError(f"tensor_parallel_size must be >= 1 and collective_timeout_s > 0; got "
                             f"{self.tensor_parallel_size} and {self.collective_timeout_s}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        if not (self.fair_share_prompt_weight >= 0 and self.fair_share_output_weight >= 0):
            raise ValueError("fair_share_prompt_weight and fair_share_output_weight must be >= 0")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {self.quantization!r} is not supported; supported: "
                             f"{', '.join(QUANTIZATIONS)} (or unset: bf16 weights)")
        resolve_dtype(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)

    def model_len(self, args: ModelArgs) -> int:
        """The context limit: max_model_len, capped at what the model's positions allow."""
        limit = args.max_position_embeddings
        return min(self.max_model_len or limit, limit)
