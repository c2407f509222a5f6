"""What this router sent where, recently: a prompt's blocks count as cached on its replica before any report says so.

Without it a burst of requests with one new prefix would scatter: each is routed before the replica that got the
first one has reported caching it. Entries expire after ``ttl_s`` (a few report periods, by which time the replica's
own digest shows the blocks, or shows that they were evicted) and each replica keeps at most ``max_blocks``.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from engine.hashing import BlockHash


class RoutedPrefixMemory:
    def __init__(self, ttl_s: float, max_blocks: int) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        # Per replica: block hash -> expiry time, oldest first.
        self._blocks: dict[str, OrderedDict[BlockHash, float]] = {}

    def remember(self, replica: str, block_hashes: Sequence[BlockHash], now: float) -> None:
        if not block_hashes or self.ttl_s <= 0 or self.max_blocks <= 0:
            return
        blocks = self._blocks.setdefault(replica, OrderedDict())
        expires = now + self.ttl_s
        for block_hash in block_hashes:
            blocks[block_hash] = expires
            blocks.move_to_end(block_hash)
        self._expire(blocks, now)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def longest_prefix(self, replica: str, block_hashes: Sequence[BlockHash], now: float) -> int:
        blocks = self._blocks.get(replica)
        if not blocks:
            return 0
        matched = 0
        for block_hash in block_hashes:
            expires = blocks.get(block_hash)
            if expires is None or expires <= now:
                break
            matched += 1
        return matched

    def forget(self, replica: str) -> None:
        self._blocks.pop(replica, None)

    def keep_only(self, replicas: Iterable[str]) -> None:
        alive = set(replicas)
        for replica in [r for r in self._blocks if r not in alive]:
            del self._blocks[replica]

    def num_blocks(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))

    @staticmethod
    def _expire(blocks: OrderedDict[BlockHash, float], now: float) -> None:
        # Entries are ordered by last refresh, and every refresh sets the same TTL, so expiry order is list order.
        while blocks:
            block_hash, expires = next(iter(blocks.items()))
            if expires > now:
                return
            del blocks[block_hash]
