"""bench-peers cleans up after the servers it stops."""
from __future__ import annotations

import mmap

from benchmarks.bench_peers import shm_names, sweep_shm


def test_shared_memory_a_stopped_server_left_behind_is_removed_and_nothing_else(tmp_path):
    (tmp_path / "psm_before").write_bytes(b"x")
    before = shm_names(tmp_path)
    for name in ("psm_leaked", "sem.mp-leaked", "__KMP_REGISTERED_LIB_123_0", "psm_mapped", "tokenline-weights-1.bin"):
        (tmp_path / name).write_bytes(b"x" * 4096)
    with open(tmp_path / "psm_mapped", "r+b") as f, mmap.mmap(f.fileno(), 4096):
        # held by this process (open and mapped): still in use, kept; another program's file: not ours to remove
        assert sweep_shm(before, tmp_path) == ["__KMP_REGISTERED_LIB_123_0", "psm_leaked", "sem.mp-leaked"]
    assert shm_names(tmp_path) == {"psm_before", "psm_mapped", "tokenline-weights-1.bin"}
    assert sweep_shm(shm_names(tmp_path), tmp_path) == []
