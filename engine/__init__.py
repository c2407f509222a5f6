"""tokenline's inference engine: continuous batching over a paged, prefix-cached KV cache."""
import os as _os

# The native kernels split each operator over their own threads (engine/kernels/thread_pool.h); torch's own parallel
# ops (a top-p sort, a long prompt's oneDNN linears) still use OpenMP, whose idle thread spins for several ms after
# each by default, on a core the kernels' threads want. libgomp reads this once, when torch loads it: it takes
# effect where torch is not imported yet (engine replicas also get it in their environment, deployments/app.py).
GOMP_SPINCOUNT = "10000"  # about 0.1 ms of spinning
if _os.environ.get("TOKENLINE_KERNEL_POOL") != "0":
    _os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
from engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError
from engine.config import EngineConfig, ModelArgs
from engine.hashing import hash_block_chain, hash_block_tokens
from engine.llm_engine import LLMEngine
from engine.outputs import EngineOutput, EngineStats, SchedulerStats
from engine.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError", "EngineOverloadedError",
           "EngineConfig", "ModelArgs", "LLMEngine", "EngineOutput", "EngineStats", "SchedulerStats",
           "InvalidRequestError", "SamplingParams", "hash_block_chain", "hash_block_tokens"]
