"""Block hashes for the prefix cache, identical in every process.

A full block's hash is chained from its parent's: ``H(parent_hash, token_ids, extra_keys)``. Python's
``hash()`` is salted per process, so we use BLAKE2b over a fixed byte encoding: the router computes the
same values in another process from the same token ids.
"""
from __future__ import annotations

import hashlib
import struct
from array import array
from typing import Sequence

BlockHash = int

# The chain's root: a request's first block hashes against this instead of a parent.
ROOT_HASH: BlockHash = int.from_bytes(hashlib.blake2b(b"tokenline-kv-root", digest_size=8).digest(), "little")


def root_hash(cache_salt: str | None) -> BlockHash:
    """Where a prompt's chain starts: with a salt, no block matches a block hashed with another salt (or none)."""
    if cache_salt is None:
        return ROOT_HASH
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", ROOT_HASH))
    h.update(cache_salt.encode())
    return int.from_bytes(h.digest(), "little")


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple | None = None) -> BlockHash:
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", ROOT_HASH if parent_hash is None else parent_hash))
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return int.from_bytes(h.digest(), "little")


def hash_block_chain(token_ids: Sequence[int], block_size: int, extra_keys: tuple | None = None,
                     parent_hash: BlockHash | None = None, start: int = 0) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids[start:]`` (``start`` a multiple of block_size)."""
    hashes = []
    for begin in range(start, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block_tokens(parent_hash, token_ids[begin:begin + block_size], extra_keys)
        hashes.append(parent_hash)
    return hashes
