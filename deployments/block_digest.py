"""A replica's prefix cache described in a fixed number of bytes: a Bloom filter over its cached block hashes.

The router asks one question of it: how many leading blocks of this prompt does the replica hold? Block hashes
are chained, so a hit on block i implies the replica once computed blocks 0..i-1 too; the answer is the first
block the filter says is absent. A false positive (about 0.7% per block at 10 bits per block, full pool) can
only stretch a real match by a block, never invent a long one: every earlier block must also pass.

The filter has a power-of-two size fixed by the pool (``num_kv_blocks * bits_per_block``, capped), so its size
never depends on load, and every replica of one deployment builds the same size: the router computes a prompt's
probe positions once and tests them against every replica's filter.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from deployments.records import ReplicaStats
from deployments.router_config import RouterArgs

NUM_PROBES = 7  # optimal for ~10 bits per element: (ln 2) * 10
_LOW32 = np.uint64(0xFFFFFFFF)


def digest_num_bits(num_kv_blocks: int, bits_per_block: int, max_bytes: int) -> int:
    """The filter's size in bits: the power of two at or above num_kv_blocks * bits_per_block, capped."""
    wanted = max(64, num_kv_blocks * bits_per_block)
    cap = max(64, max_bytes * 8)
    return min(1 << (wanted - 1).bit_length(), 1 << (cap.bit_length() - 1))


def replica_digest_bits(router: RouterArgs, num_kv_blocks: int) -> int:
    """The digest size a replica reports; 0 (no digest) when the deployment routes without it."""
    if router.policy != "prefix_aware":
        return 0
    return digest_num_bits(num_kv_blocks, router.digest_bits_per_block, router.digest_max_bytes)


def probe_positions(block_hashes: np.ndarray | Sequence[int], num_bits: int) -> np.ndarray:
    """Bit positions of each hash, shape (len, NUM_PROBES): double hashing on the hash's two 32-bit halves."""
    hashes = np.asarray(block_hashes, dtype=np.uint64)
    low = hashes & _LOW32
    high = (hashes >> np.uint64(32)) | np.uint64(1)  # odd, so the probes of one hash never coincide
    steps = np.arange(NUM_PROBES, dtype=np.uint64)
    # uint64 arithmetic wraps; the mask keeps a power-of-two modulus exact.
    return (low[:, None] + steps[None, :] * high[:, None]) & np.uint64(num_bits - 1)


def build_digest(block_hashes: np.ndarray | Sequence[int], num_bits: int) -> bytes:
    bits = np.zeros(num_bits, dtype=bool)
    if len(block_hashes):
        bits[probe_positions(block_hashes, num_bits).ravel()] = True
    return np.packbits(bits, bitorder="little").tobytes()


def longest_cached_prefix(digest: bytes, positions: np.ndarray) -> int:
    """Leading blocks whose every probe bit is set; ``positions`` from probe_positions with this digest's size."""
    if not len(positions) or not digest:
        return 0
    filter_bytes = np.frombuffer(digest, dtype=np.uint8)
    bits = (filter_bytes[positions >> np.uint64(3)] >> (positions & np.uint64(7)).astype(np.uint8)) & 1
    present = bits.all(axis=1)
    return len(present) if present.all() else int(np.argmin(present))


def with_block_digest(stats: ReplicaStats, block_hashes: np.ndarray, block_size: int, num_bits: int) -> ReplicaStats:
    """The replica's stats plus what the router needs to route by prefix: block size, a timestamp, the digest of
    `block_hashes` (the engine's cached ones, engine.block_pool.BlockPool.cached_hashes)."""
    return dataclasses.replace(stats, block_size=block_size, reported_at=time.time(),
                               cached_block_digest=build_digest(block_hashes, num_bits))
