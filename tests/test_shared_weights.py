"""One copy of the packed weights for every engine of a model on a node (engine/shared_weights.py): engines in one
process and in several map the same file and answer as an engine with its own copy; the last one to let go
unlinks it; a file left by a process that died is swept by the next engine; where the directory cannot hold it,
the engine keeps its own copy."""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.kernels import native_int8_available, native_linear_available
from engine.shared_weights import PREFIX, SUFFIX, _index, _key, packed_tensors, sweep
from tests.test_huge_pages import answers
from tests.tiny_models import write_tiny_model

pytestmark = pytest.mark.skipif(not native_linear_available(), reason="no native linear kernel on this CPU")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("shared") / "m"
    write_tiny_model(path, "llama", hidden_size=128, intermediate_size=256)
    return str(path)


def config(model: str, directory: Path | None, **overrides) -> EngineConfig:
    return EngineConfig(model=model, dtype="bfloat16", num_kv_blocks=256, block_size=16, max_num_batched_tokens=64,
                        huge_pages=False, share_weights=directory is not None, shared_weights_dir=str(directory),
                        **overrides)


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob(f"{PREFIX}*{SUFFIX}"))


def test_engines_share_one_file_and_answer_as_with_their_own_copy(model, tmp_path):
    own = LLMEngine(config(model, None))
    assert own.runner.shared_weights is None
    first, second = LLMEngine(config(model, tmp_path)), LLMEngine(config(model, tmp_path))
    a, b = first.runner.shared_weights, second.runner.shared_weights
    assert a.report.created and not b.report.created and a.path == b.path
    assert files(tmp_path) == [a.path.name] and a.report.bytes == os.path.getsize(a.path) - (2 << 20)
    # Every packed tensor a step streams lies in the file, with the bytes the engine would have packed itself.
    mine = {(name, field): t for name, field, t in packed_tensors(own.runner.model)}
    theirs = packed_tensors(second.runner.model)
    assert len(theirs) == len(mine) == a.report.tensors
    for name, field, t in theirs:
        assert torch.equal(t.view(torch.uint8), mine[name, field].view(torch.uint8))
        assert not t.untyped_storage().resizable()  # a view of the mapping, not a copy
    expected = answers(own)
    assert answers(first) == expected and answers(second) == expected
    first.close()
    assert files(tmp_path) == [a.path.name]  # the second engine still holds it
    assert answers(second) == expected  # and still reads it
    second.close()
    assert files(tmp_path) == []
    # Another model's weights are another file.
    other = tmp_path / "other"
    write_tiny_model(other, "llama", seed=1, hidden_size=128, intermediate_size=256)
    third, fourth = LLMEngine(config(model, tmp_path)), LLMEngine(config(str(other), tmp_path))
    assert third.runner.shared_weights.path != fourth.runner.shared_weights.path and len(files(tmp_path)) == 2
    third.close()
    fourth.close()
    assert files(tmp_path) == []


HOLDER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    from engine import EngineConfig, LLMEngine
    engine = LLMEngine(EngineConfig(model={model!r}, dtype="bfloat16", num_kv_blocks=64, block_size=16,
                                    max_num_batched_tokens=64, huge_pages=False, shared_weights_dir={directory!r}))
    shared = engine.runner.shared_weights
    print(shared.path, os.stat(shared.path).st_ino, int(shared.report.created), flush=True)
    if sys.stdin.readline().strip() == "die":
        os._exit(0)  # as a killed replica: no release
    engine.close()
""")


def holder(model: str, directory: Path) -> tuple[subprocess.Popen, list[str]]:
    code = HOLDER.format(root=str(ROOT), model=model, directory=str(directory))
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = proc.stdout.readline().split()
    if len(line) != 3:
        proc.kill()
        proc.wait(timeout=30)
        pytest.fail(f"the holder process printed {line!r}")
    return proc, line


def finish(proc: subprocess.Popen, how: str) -> None:
    try:
        proc.stdin.write(how + "\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_processes_map_one_copy_and_the_last_one_unlinks_it(model, tmp_path):
    first, (path, inode, created) = holder(model, tmp_path)
    try:
        second, (path2, inode2, created2) = holder(model, tmp_path)
        try:
            assert (path2, inode2, created, created2) == (path, inode, "1", "0")
            finish(first, "close")
            assert files(tmp_path) == [Path(path).name]
        finally:
            finish(second, "close")
        assert files(tmp_path) == []
    finally:
        if first.poll() is None:
            finish(first, "close")


def test_a_file_left_by_a_dead_process_is_swept_by_the_next_engine(model, tmp_path):
    proc, (path, _, _) = holder(model, tmp_path)
    finish(proc, "die")
    assert files(tmp_path) == [Path(path).name]  # nobody let go of it
    stale = tmp_path / f".{PREFIX}half-written"
    stale.write_bytes(b"x")
    engine = LLMEngine(config(model, tmp_path))
    shared = engine.runner.shared_weights
    assert shared.report.created and shared.path.name == Path(path).name and not stale.exists()
    assert sweep(tmp_path) == []  # a file an engine holds stays
    engine.close()
    assert files(tmp_path) == []


def test_weights_stay_private_where_the_directory_cannot_hold_them(model, tmp_path):
    own = LLMEngine(config(model, None))
    expected = answers(own)
    missing = LLMEngine(config(model, tmp_path / "missing"))
    assert missing.runner.shared_weights is None and answers(missing) == expected
    # A file under the right name whose index does not match is neither used nor removed.
    tensors = packed_tensors(own.runner.model)
    entries, _ = _index(tensors)
    bad = tmp_path / f"{PREFIX}{_key(entries, tensors)}{SUFFIX}"
    bad.write_bytes(b"TLWEIGHT" + bytes(4096))
    with open(bad, "rb") as held:  # as another engine holding it would
        fcntl.flock(held, fcntl.LOCK_SH)
        engine = LLMEngine(config(model, tmp_path))
        assert engine.runner.shared_weights is None and answers(engine) == expected
        assert bad.exists()


@pytest.mark.skipif(not native_int8_available(), reason="int8 weights need AVX512-VNNI or AVX2")
def test_int8_weights_are_shared_too(model, tmp_path):
    own = LLMEngine(config(model, None, quantization="int8"))
    first, second = (LLMEngine(config(model, tmp_path, quantization="int8")) for _ in range(2))
    assert not second.runner.shared_weights.report.created
    assert {field for _, field, _ in packed_tensors(second.runner.model)} == {"packed", "packed_int8", "scales"}
    assert answers(first) == answers(own) == answers(second)
    first.close()
    second.close()
    assert files(tmp_path) == []
