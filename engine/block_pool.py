"""The pool of KV blocks: ref counts, the prefix-cache hash map, and an LRU list of free blocks."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from engine.hashing import BlockHash


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first; a freed block keeps its hash until it is reused.
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockHash, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def cached_hashes(self) -> np.ndarray:
        """Every hash the pool can serve a hit from, free-but-unevicted blocks included (uint64)."""
        return np.fromiter(self.cached, dtype=np.uint64, count=len(self.cached))

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        block_id = self.cached.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cache hits, pulling free ones out of the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_blocks[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self.free_blocks):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self.free_blocks)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free_blocks.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def uncache(self, block: KVBlock) -> None:
        """Forget a block's hash: its contents can no longer be vouched for."""
        self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block.block_id:
                del self.cached[block.block_hash]
            block.block_hash = None

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a block whose tokens are now full. A duplicate of an existing entry stays unlisted."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block.block_id)

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each; callers pass tail blocks first so they are evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                if block.block_hash is None or self.cached.get(block.block_hash) != block.block_id:
                    # Nothing anyone can look up: put it where it is taken first.
                    self.free_blocks[block.block_id] = None
                    self.free_blocks.move_to_end(block.block_id, last=False)
                else:
                    self.free_blocks[block.block_id] = None

    def reset_prefix_cache(self) -> bool:
        if any(b.ref_cnt for b in self.blocks):
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True
