"""The kernels' own threads (engine/kernels/thread_pool.h): every item runs once, a thread that falls behind has its
chunks taken by the others, and the kernels give the same bits on the pool as on OpenMP."""
from __future__ import annotations

import pytest
import torch

from engine import kernels

pytestmark = pytest.mark.skipif(not kernels.cpu_kernels_available(), reason="native CPU kernels unavailable")


@pytest.fixture
def two_threads():
    before, pool = torch.get_num_threads(), torch.ops.tokenline.kernel_pool()
    torch.set_num_threads(2)
    torch.ops.tokenline.kernel_pool(1)
    yield
    torch.set_num_threads(before)
    torch.ops.tokenline.kernel_pool(int(pool))


@pytest.mark.parametrize("n,grain", [(1, 1), (7, 1), (64, 1), (100, 16), (1000, 3), (33, 32)])
def test_every_item_runs_once(two_threads, n, grain):
    trace = torch.ops.tokenline.pool_trace(n, grain)
    assert trace[:, 1].tolist() == [1] * n
    assert set(trace[:, 0].tolist()) <= {0, 1}


def test_a_slow_thread_has_its_chunks_taken(two_threads):
    # The caller owns the first half of the chunks (8 of 16 items each): every item it owns sleeps 2 ms, so the
    # worker finishes its own half first and takes the caller's last chunks from the back.
    trace = torch.ops.tokenline.pool_trace(64, 8, 32, 2000)
    assert trace[:, 1].tolist() == [1] * 64
    first_half = trace[:32, 0].tolist()
    assert first_half[:8] == [0] * 8  # the caller starts on its own first chunk
    assert 1 in first_half  # the worker took some of the caller's chunks
    assert trace[32:, 0].tolist() == [1] * 32  # and ran all of its own


def test_one_thread_runs_inline_on_the_caller():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.ops.tokenline.pool_trace(50, 1)[:, 0].tolist() == [0] * 50
    finally:
        torch.set_num_threads(before)


def test_off_falls_back_to_openmp(two_threads):
    torch.ops.tokenline.kernel_pool(0)
    assert not torch.ops.tokenline.kernel_pool()
    assert torch.ops.tokenline.pool_trace(40, 4)[:, 1].tolist() == [1] * 40


@pytest.mark.skipif(not kernels.native_linear_available(), reason="no native linear on this CPU")
@pytest.mark.parametrize("rows", [1, 8, 16, 32, 64, 200])
def test_linear_same_bits_on_pool_and_openmp(two_threads, rows):
    torch.manual_seed(rows)
    weight = torch.randn(1000, 576, dtype=torch.bfloat16)
    packed = torch.ops.tokenline.pack_linear_weight(weight)
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    outs = []
    for on in (1, 0):
        torch.ops.tokenline.kernel_pool(on)
        out = torch.empty(rows, 1000, dtype=torch.bfloat16)
        torch.ops.tokenline.packed_linear(out, x, packed, None, 1000)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    ref = (x.float() @ weight.float().T)
    torch.testing.assert_close(outs[0].float(), ref, rtol=2e-2, atol=5e-2)


def test_attention_same_bits_on_pool_and_openmp(two_threads):
    torch.manual_seed(0)
    blocks, block_size, kv_heads, head_dim, heads, batch = 64, 16, 3, 64, 9, 12
    k_cache = torch.randn(blocks, kv_heads, block_size, head_dim, dtype=torch.bfloat16)
    v_cache = torch.randn(blocks, kv_heads, block_size, head_dim, dtype=torch.bfloat16)
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16)
    seq_lens = torch.randint(1, 5 * block_size, (batch,), dtype=torch.int64)
    block_tables = torch.randperm(blocks)[:batch * 5].view(batch, 5).to(torch.int64)
    outs = []
    for on in (1, 0):
        torch.ops.tokenline.kernel_pool(on)
        out = torch.empty(batch, heads * head_dim, dtype=torch.bfloat16)
        kernels.paged_decode_attention(out, q, k_cache, v_cache, block_tables, seq_lens, head_dim ** -0.5)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_a_forked_child_starts_its_own_workers(two_threads):
    import os
    import time

    assert torch.ops.tokenline.pool_trace(64, 4)[:, 1].tolist() == [1] * 64  # the parent's workers exist
    pid = os.fork()
    if pid == 0:  # the child: the parent's worker threads did not come along
        ok = torch.ops.tokenline.pool_trace(64, 4, 16, 500)[:, 1].tolist() == [1] * 64
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's parallel_for did not finish")
