"""Which blocks a request holds: prefix-cache lookups, slot allocation for a step, and freeing."""
from __future__ import annotations

from dataclasses import dataclass

from engine.block_pool import BlockPool, KVBlock
from engine.request import Request


@dataclass
class PrefixCacheStats:
    """Counted in tokens, as vLLM does: queries are prompt tokens looked up, hits those found cached."""

    queries: int = 0
    hits: int = 0

    def reset(self) -> "PrefixCacheStats":
        out = PrefixCacheStats(self.queries, self.hits)
        self.queries = self.hits = 0
        return out


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of a request that holds no blocks yet, in whole blocks."""
        # Prompt logprobs come from the prefill's logits: a request that asks for them computes every prompt token.
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        # The last token is always recomputed: its logits are needed to sample the next one.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        self.stats.queries += request.num_tokens
        self.stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None) -> bool:
        """Reserve room for ``num_new_tokens`` more tokens; False (and nothing changed) if the pool is short."""
        new_computed_blocks = new_computed_blocks or []
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total_blocks = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = total_blocks - len(request.block_ids) - len(new_computed_blocks)
        # Cache hits sitting in the free list stop being free once touched.
        free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - free_hits:
            return False
        self.pool.touch(new_computed_blocks)
        request.block_ids.extend(b.block_id for b in new_computed_blocks)
        if num_new_blocks > 0:
            request.block_ids.extend(b.block_id for b in self.pool.allocate(num_new_blocks))
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return True

    def _cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        if not self.enable_caching:
            return
        num_full = min(num_tokens_after_step // self.block_size, len(request.block_hashes))
        for i in range(num_full - 1, -1, -1):
            block = self.pool.blocks[request.block_ids[i]]
            if block.block_hash is not None:
                break  # blocks before an already-cached one are cached too
            self.pool.cache_block(block, request.block_hashes[i])

    def free(self, request: Request, num_valid_tokens: int | None = None) -> None:
        """Drop the request's blocks. With `num_valid_tokens`, blocks past that many tokens were registered in the
        prefix cache for a step that never finished: their hashes go, so no later prompt reads their KV."""
        blocks = [self.pool.blocks[i] for i in request.block_ids]
        if num_valid_tokens is not None:
            for block in blocks[num_valid_tokens // self.block_size:]:
                self.pool.uncache(block)
        self.pool.free(blocks[::-1])
        request.block_ids = []

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
