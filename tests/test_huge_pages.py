"""The engine's weights and KV cache on transparent huge pages (engine/huge_pages.py): which frames are asked for,
that the kernel's collapse leaves every byte as it was, and that an engine with it answers as one without."""
from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.huge_pages import MIN_FILL, collapse, huge_page_size, module_tensors, tensor_frames, thp_mode
from tests.tiny_models import write_tiny_model

FRAME = 2 << 20
needs_thp = pytest.mark.skipif(thp_mode() in (None, "never") or huge_page_size() != FRAME,
                               reason="no transparent huge pages of 2 MiB in this kernel")


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_frames_are_those_the_tensors_fill():
    t = torch.empty(5 * FRAME, dtype=torch.uint8)
    start, end = t.data_ptr(), t.data_ptr() + t.numel()
    frames = tensor_frames([t, t[FRAME:], t.view(torch.bfloat16)], FRAME)  # views of one storage count once
    assert frames == sorted(set(frames)) and all(f % FRAME == 0 for f in frames)
    for f in frames:
        assert min(end, f + FRAME) - max(start, f) >= MIN_FILL * FRAME
    inner = [f for f in range(start - start % FRAME, end, FRAME) if f >= start and f + FRAME <= end]
    assert set(inner) <= set(frames) and len(inner) >= 4
    assert tensor_frames([torch.empty(1000)], FRAME) == []  # a small tensor fills no frame
    assert tensor_frames([torch.empty(0), None], FRAME) == []
    if torch.backends.mkldnn.is_available():  # an opaque tensor (oneDNN's layout) has no storage to ask for
        assert tensor_frames([torch.randn(1024, 1024).to_mkldnn()], FRAME) == []


@needs_thp
def test_collapse_keeps_every_byte_and_uses_huge_pages():
    t = torch.randn(8 * FRAME // 4)  # 16 MiB of fp32, touched on 4 KiB pages
    before = t.clone()
    report = collapse([t])
    assert report.frames >= 7
    assert torch.equal(t, before)
    if report.collapsed == 0:
        pytest.skip(f"the kernel collapsed no frame: {report.reason}")
    assert anon_huge_kib(t.data_ptr() + 4 * FRAME) >= report.frame_bytes // 1024
    t.add_(1)  # the memory stays writable, through the same tensor
    assert torch.equal(t, before + 1)


def answers(engine: LLMEngine) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(3, 60)), params)
    engine.add_request("b", [7, 8, 9], params)
    out: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(100):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


def test_engine_answers_the_same_on_huge_pages(tmp_path):
    path = tmp_path / "m"
    write_tiny_model(path, "llama", hidden_size=256, intermediate_size=1024)
    config = dict(model=str(path), dtype="bfloat16", num_kv_blocks=2048, block_size=16, max_num_batched_tokens=64)
    plain = LLMEngine(EngineConfig(huge_pages=False, **config))
    assert plain.runner.huge_pages is None
    huge = LLMEngine(EngineConfig(huge_pages=True, **config))
    job = huge.runner.huge_pages
    assert job is not None and job.join(timeout=120)
    if thp_mode() not in (None, "never") and huge_page_size() == FRAME:
        # The KV cache (2048 blocks: 8 MiB a layer here) fills frames of its own.
        assert job.report.frames >= 4 and job.seconds is not None
    assert answers(huge) == answers(plain)
    # Prepacked weights are plain attributes, not parameters: they are asked for too.
    held = {id(t) for t in module_tensors(huge.runner.model)}
    packed = [lin.packed for layer in huge.runner.model.layers for lin in layer.linears() if lin.packed is not None]
    assert packed and all(id(t) in held for t in packed)
    # ... and the weights they stand in for, which no step reads, are not.
    superseded = [lin.weight for layer in huge.runner.model.layers for lin in layer.linears() if lin.packed is not None]
    assert not any(id(t) in held for t in superseded)
    assert huge.settle(timeout_s=1)
