"""tokenline's inference engine: continuous batching over a paged, prefix-cached KV cache."""
from engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError
from engine.config import EngineConfig, ModelArgs
from engine.hashing import hash_block_chain, hash_block_tokens
from engine.llm_engine import LLMEngine
from engine.outputs import EngineOutput, EngineStats, SchedulerStats
from engine.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError", "EngineOverloadedError",
           "EngineConfig", "ModelArgs", "LLMEngine", "EngineOutput", "EngineStats", "SchedulerStats",
           "InvalidRequestError", "SamplingParams", "hash_block_chain", "hash_block_tokens"]
