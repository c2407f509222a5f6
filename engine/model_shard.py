"""What every rank of an engine holds: its part of the model, its KV cache and attention backend, and the forward
of a step from its inputs (engine/step_inputs.py). On one device the shard is the whole model; rank 0's
ModelRunner adds scheduling-facing input preparation and sampling on top.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping

import torch

from engine.attention import CpuAttention, select_backend
from engine.config import EngineConfig, ModelArgs
from engine.cuda_graphs import CudaGraphRunner
from engine.host_copies import to_device
from engine.huge_pages import BackgroundCollapse, module_tensors, release_free_heap
from engine.loader import CheckpointTensor
from engine.models.layers import default_native_max_rows, onednn_prepack_available, select_linear_packing
from engine.models.llama import LlamaForCausalLM
from engine.scheduler import ScheduledRequest
from engine.shared_weights import SharedWeights, default_dir, share_packed_weights
from engine.step_inputs import PROMPT_LOGPROBS_ROWS, StepInputs
from engine.tp_group import TensorParallelGroup
from engine.tp_layout import ShardLayout

log = logging.getLogger(__name__)

Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, CheckpointTensor]]


def _log_huge_pages(job: BackgroundCollapse) -> None:
    report = job.report
    log.info("weights and KV cache: %d of %d %d MiB frames on huge pages in %.2f s%s", report.collapsed,
             report.frames, report.frame_bytes >> 20, job.seconds, f" ({report.reason})" if report.reason else "")


class ModelShard:
    def __init__(self, config: EngineConfig, args: ModelArgs, weights: Weights, max_model_len: int,
                 group: TensorParallelGroup | None = None, device: torch.device | str | None = None,
                 check_peers=lambda: None) -> None:
        """Loads this rank's weights; with a `group`, then waits for the other ranks and agrees with them on the
        KV pool's size and on CUDA graphs (`check_peers` raises if a rank died meanwhile)."""
        self.config, self.args, self.group = config, args, group
        self.device = torch.device(device or config.device)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.layout = ShardLayout.of(args, group.rank, group.world_size) if group else ShardLayout.full(args)
        backend = select_backend(config.attention_backend, self.device, self.layout.num_heads,
                                 self.layout.num_kv_heads, args.head_dim, config.block_size, self.dtype)
        self.backend, self.attention_backend = backend, backend.name
        if isinstance(backend, CpuAttention) and not config.attention_query_tiles:
            backend.query_tiles = backend.sdpa_prefill = False  # every row alone: no tile, no SDPA over a chunk
        with torch.device(self.device):  # parameters born on the GPU: no host copy of a large model
            model = LlamaForCausalLM(args, backend, self.dtype, max_model_len, self.layout, group)
        model.load_weights(weights)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        if backend.name == "cpu":
            self.model.use_cpu_kernels()
        self.linear_packing = select_linear_packing(self.device, self.dtype, config.prepack_weights,
                                                    config.quantization)
        if self.linear_packing:
            self.model.prepack_linears(self.linear_packing)
        self.shared_weights: SharedWeights | None = None
        if self.linear_packing in ("native", "native-int8") and config.share_weights:
            self.shared_weights = self._share_weights(config.shared_weights_dir or default_dir())
        self.native_max_rows: int | None = None  # larger steps run oneDNN's linears (AMX where the CPU has it)
        if self.linear_packing in ("native", "native-int8") and onednn_prepack_available():
            self.native_max_rows = config.native_linear_max_rows
            if self.native_max_rows is None:
                self.native_max_rows = default_native_max_rows()
            if self.native_max_rows is not None and self.native_max_rows < config.max_num_batched_tokens:
                self.model.use_onednn_above(self.native_max_rows)
            else:
                self.native_max_rows = None
        if backend.name == "cpu":
            self.model.use_native_layers()
        if self.linear_packing:  # the packed copies stand in for the plain weights from here on
            log.info("plain linear weights superseded by packed ones: %d MiB let go",
                     self.model.drop_plain_weights() >> 20)
            release_free_heap()
        if group is not None:
            group.connect(check_peers)
        self.graph_runner: CudaGraphRunner | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = self._num_blocks()
        if group is not None:
            self.num_blocks = group.min(self.num_blocks)
        k_shape, v_shape = backend.key_cache_shape(self.num_blocks), backend.kv_cache_shape(self.num_blocks)
        self.kv_caches = [(torch.zeros(k_shape, dtype=self.dtype, device=self.device),
                           torch.zeros(v_shape, dtype=self.dtype, device=self.device)) for _ in range(args.num_layers)]
        self.huge_pages: BackgroundCollapse | None = None
        if self.device.type == "cpu" and config.huge_pages:
            tensors = module_tensors(self.model) + [t for pair in self.kv_caches for t in pair]
            self.huge_pages = BackgroundCollapse(tensors, on_done=_log_huge_pages)
        self.graph_runner = self._capture_graphs()

    def _share_weights(self, directory: str | None) -> SharedWeights | None:
        if directory is None:
            log.info("packed weights: private to this engine (no writable /dev/shm; set engine.shared_weights_dir)")
            return None
        shared, report = share_packed_weights(self.model, directory)
        if shared is None:
            log.warning("packed weights: private to this engine (%s); with room in engine.shared_weights_dir the "
                        "node's engines of this model would hold one copy", report.reason)
        else:
            log.info("packed weights: %d MiB %s %s in %.2f s", report.bytes >> 20,
                     "written to" if report.created else "shared from", report.path, report.seconds)
        return shared

    def release_weights(self) -> None:
        """Lets go of the node's shared copy of the weights (unlinking it where this engine held it last); the
        mapping stays valid while this engine's tensors are alive."""
        if self.shared_weights is not None:
            self.shared_weights.release()

    @property
    def kv_bytes_per_block(self) -> int:
        return 2 * self.args.num_layers * self.block_size * self.layout.num_kv_heads * self.args.head_dim * \
            self.dtype.itemsize

    def _num_blocks(self) -> int:
        if self.config.num_kv_blocks:
            return self.config.num_kv_blocks
        budget = self.config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            from engine.gpu_memory import profile_kv_cache_bytes
            budget = profile_kv_cache_bytes(self, self.max_model_len)
        return max(1, budget // self.kv_bytes_per_block)

    def _capture_graphs(self) -> CudaGraphRunner | None:
        """Decode-step CUDA graphs where they can run: CUDA, a backend whose kernels replay, not enforce_eager.
        Every rank captures or none does: their steps' collectives must pair up."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return None
        if not self.backend.supports_cuda_graphs:
            log.info("the %s attention backend does not replay in CUDA graphs; decode steps run eagerly",
                     self.backend.name)
            return None
        runner = CudaGraphRunner(self.model, self.kv_caches, self.config.max_num_seqs, self.max_model_len,
                                 self.block_size, self.device)
        captured = runner.capture()
        if self.group is not None:
            captured = bool(self.group.min(int(captured)))
        return runner if captured else None

    def forward(self, step: StepInputs) -> torch.Tensor:
        """The step's forward on this rank: hidden states of every new token."""
        input_ids, positions, meta = step.device_inputs(self.backend, self.block_size, self.device)
        graphs = self.graph_runner
        if graphs is not None and graphs.can_run(meta, input_ids.shape[0]):
            return graphs.forward(input_ids, positions, meta)
        return self.model(input_ids, positions, self.kv_caches, meta)

    def logits(self, step: StepInputs, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits of the step's logit rows: on rank 0 (None elsewhere, or when the step asks for none)."""
        if step.logit_rows.numel() == 0:
            return None
        # index_select, not hidden[rows]: on CPU, advanced indexing opens an OpenMP region at a few rows, whose idle
        # thread then spins on a core the kernels' own threads want (engine/step_inputs.request_of_each_token).
        return self.model.compute_logits(hidden.index_select(0, to_device(step.logit_rows, self.device)))

    def prompt_logits(self, step: StepInputs, hidden: torch.Tensor) -> Iterator[torch.Tensor | None]:
        """fp32 logits of the step's prompt rows, PROMPT_LOGPROBS_ROWS at a time (None on ranks other than 0)."""
        if step.prompt_rows.numel() == 0:
            return  # split() would still give one empty chunk
        for rows in step.prompt_rows.split(PROMPT_LOGPROBS_ROWS):
            yield self.model.compute_logits(hidden[to_device(rows, self.device)])

    @torch.inference_mode()
    def run(self, step: StepInputs) -> None:
        """The other ranks' side of a step: the same forward and logits as rank 0's."""
        hidden = self.forward(step)
        self.logits(step, hidden)
        for _ in self.prompt_logits(step, hidden):
            pass

    def execute(self, scheduled: list[ScheduledRequest]) -> dict:
        """The other ranks' side of a profiling step (engine/gpu_memory.py)."""
        self.run(StepInputs.build(sorted(scheduled, key=lambda s: s.num_new_tokens != 1)))
        return {}
