"""The decoder layers in one native call (engine/kernels/llama_cpu.cpp) against the same layers run from Python:
the same kernels in the same order, so the same bits, over prefills, chunked prefills beside decodes, and decodes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kernels import native_int8_available, native_layers_available, packed_keys_supported
from engine.models.llama import NATIVE_LAYERS_ENV
from tests.tiny_models import write_tiny_model

needs_native = pytest.mark.skipif(not native_layers_available(),
                                  reason="this CPU has neither AVX512-BF16 nor AVX2 with FMA (or no C++ "
                                         "toolchain): the native layers are not built")

# head_dim 64: the key layouts the layers' attention reads (packed, or plain on the AVX2 kernel).
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def engine_for(path, monkeypatch, native: bool, **config) -> LLMEngine:
    """The native kernel for every linear, unless `native_linear_max_rows` says otherwise."""
    monkeypatch.setenv(NATIVE_LAYERS_ENV, "1" if native else "0")
    config = {"max_num_batched_tokens": 2048, "native_linear_max_rows": 2048, **config}
    return LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", num_kv_blocks=64, block_size=16, **config))


def tokens_and_logprobs(engine: LLMEngine) -> dict[str, list]:
    """Three requests, the third arriving while the others decode; a step budget of 48 tokens splits the longer
    prompts into chunks, so steps mix prefill chunks with context and decodes."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    prompts = {"a": list(range(3, 70)), "b": [5, 9, 11, 300, 42], "c": list(range(400, 300, -1))}
    engine.add_request("a", prompts["a"], params)
    engine.add_request("b", prompts["b"], params)
    seen: dict[str, list] = {}
    for step in range(200):
        if step == 4:
            engine.add_request("c", prompts["c"], params)
        for out in engine.step():
            seen.setdefault(out.request_id, []).extend(
                (token, repr(lp)) for token, lp in zip(out.new_token_ids, out.logprobs))
        if step > 4 and not engine.has_unfinished():
            break
    assert sorted(seen) == ["a", "b", "c"] and all(len(v) == 12 for v in seen.values())
    return seen


@needs_native
@pytest.mark.parametrize("family, quantization", [("llama", None), ("qwen2", None), pytest.param(
    "llama", "int8",
    marks=pytest.mark.skipif(not native_int8_available(), reason="int8 weights need AVX512-VNNI or AVX2"))])
def test_native_layers_give_the_python_layers_bits(tmp_path, monkeypatch, family, quantization):
    write_tiny_model(tmp_path, family, seed=5, **SHAPE)  # qwen2: a bias on qkv
    runs = []
    for native in (False, True):
        engine = engine_for(tmp_path, monkeypatch, native, quantization=quantization, max_num_batched_tokens=48,
                            native_linear_max_rows=48)
        assert engine.runner.model.native_layers is native
        runs.append(tokens_and_logprobs(engine))
    assert runs[0] == runs[1]


@needs_native
def test_layers_the_native_call_does_not_cover_stay_in_python(tmp_path, monkeypatch):
    write_tiny_model(tmp_path / "qwen3", "qwen3", **{**SHAPE, "head_dim": 64})  # per-head q/k norms
    assert not engine_for(tmp_path / "qwen3", monkeypatch, True).runner.model.native_layers
    write_tiny_model(tmp_path / "llama", "llama", **SHAPE)
    monkeypatch.setenv(NATIVE_LAYERS_ENV, "1")
    fp32 = LLMEngine(EngineConfig(model=str(tmp_path / "llama"), dtype="float32", num_kv_blocks=64))
    assert not fp32.runner.model.native_layers  # no native linear in fp32
    torch_backend = LLMEngine(EngineConfig(model=str(tmp_path / "llama"), dtype="bfloat16", num_kv_blocks=64,
                                           attention_backend="torch"))
    assert not torch_backend.runner.model.native_layers
    assert engine_for(tmp_path / "llama", monkeypatch, True).runner.model.native_layers


@needs_native
def test_steps_past_the_native_rows_run_the_layers_on_onednn_linears(tmp_path, monkeypatch):
    """An engine whose linears hand steps of more than 4 tokens to oneDNN: those steps run module by module, the
    smaller ones in the native call, and the answers are those of the native kernel everywhere (within bf16)."""
    from engine.models.layers import onednn_prepack_available
    from engine.models.llama import LlamaForCausalLM
    if not onednn_prepack_available():
        pytest.skip("oneDNN's prepacked linear is missing in this torch build")
    write_tiny_model(tmp_path, "llama", seed=5, **SHAPE)
    native = tokens_and_logprobs(engine_for(tmp_path, monkeypatch, True, max_num_batched_tokens=48))
    engine = engine_for(tmp_path, monkeypatch, True, max_num_batched_tokens=48, native_linear_max_rows=4)
    model = engine.runner.model
    assert engine.runner.native_max_rows == model.native_max_rows == 4 and model.native_layers
    assert all(lin.native_max_rows == 4 and lin.packed_onednn is not None for lin in model.modules()
               if hasattr(lin, "packed_onednn"))
    rows = {"native": [], "modules": []}
    native_forward, forward = LlamaForCausalLM._native_forward, LlamaForCausalLM.forward

    def spy_native(self, x, *args):
        rows["native"].append(x.shape[0])
        return native_forward(self, x, *args)

    def spy(self, input_ids, *args):
        rows["modules"].append(input_ids.shape[0])
        return forward(self, input_ids, *args)

    monkeypatch.setattr(LlamaForCausalLM, "_native_forward", spy_native)
    monkeypatch.setattr(LlamaForCausalLM, "forward", spy)
    split = tokens_and_logprobs(engine)
    assert rows["native"] and max(rows["native"]) <= 4
    assert max(rows["modules"]) > 4  # every step enters forward; the prefills left the native call
    assert {k: [t for t, _ in v] for k, v in split.items()} == {k: [t for t, _ in v] for k, v in native.items()}


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart two bf16 tensors are (sign-magnitude bits as an ordered integer line); values
    both below 1e-30 in magnitude (a denormal against 0) count as equal."""
    def line(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    tiny = (a.float().abs() < 1e-30) & (b.float().abs() < 1e-30)
    return torch.where(tiny, 0, (line(a) - line(b)).abs())


@needs_native
@pytest.mark.parametrize("rows, width", [(1, 1536), (5, 200), (37, 576)])
def test_fused_elementwise_kernels_against_torch(rows, width):
    """SiLU-and-mul and RMSNorm (with the residual add) in bf16, 16 lanes at a time with a masked tail: torch's
    arithmetic in fp32, rounded where the model rounds; the kernel's exp may differ from libm's by an ulp of fp32,
    so a bf16 result may sit one step away, rarely. fp32 keeps the scalar loop."""
    from engine import kernels
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * width, generator=g) * 4).bfloat16()
    gate_up[0, :3] = torch.tensor([-100.0, 90.0, 0.0])  # exp's ends: silu 0, x, 0
    got = kernels.silu_and_mul(gate_up)
    gate, up = gate_up.float().split(width, dim=-1)
    want = (F.silu(gate).bfloat16().float() * up).bfloat16()
    apart = ulps_apart(got, want)
    assert apart.max() <= 1 and (apart > 0).float().mean() < 0.01
    assert got[0, 1] == want[0, 1] and got[0, 2] == 0 and abs(got[0, 0].item()) < 1e-30
    fp32 = gate_up.float()
    torch.testing.assert_close(kernels.silu_and_mul(fp32), F.silu(fp32[:, :width]) * fp32[:, width:])

    x = torch.randn(rows, width, generator=g).bfloat16()
    residual = torch.randn(rows, width, generator=g).bfloat16()
    weight = (torch.rand(width, generator=g) + 0.5).bfloat16()
    summed = (residual.float() + x.float()).bfloat16()
    normed = summed.float() * torch.rsqrt(summed.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    want = (weight.float() * normed.bfloat16().float()).bfloat16()
    got = kernels.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(residual, summed)  # the residual add, in place, rounded once
    apart = ulps_apart(got, want)
    assert apart.max() <= 1 and (apart > 0).float().mean() < 0.01


@needs_native
@pytest.mark.parametrize("query_tiles", [True, False])
def test_without_query_tiles_a_prompt_read_from_the_prefix_cache_gets_the_same_bits(tmp_path, monkeypatch,
                                                                                      query_tiles):
    """A prompt whose first 64 tokens are in the prefix cache leaves 3 rows to compute: too few for a query tile,
    so they attend one by one, where the whole prompt in one chunk attended in tiles: other bits. With
    attention_query_tiles off every row attends alone either way, and the answer is the same to the bit (as it is
    on the AVX2 kernel, which has no query tiles)."""
    write_tiny_model(tmp_path, "llama", seed=5, **SHAPE)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    prompt = list(range(3, 70))

    cached = {}

    def answer(engine: LLMEngine, request_id: str, tokens: list[int]) -> list:
        engine.add_request(request_id, tokens, params)
        seen = []
        for _ in range(50):
            for out in engine.step():
                seen.extend((token, repr(lp)) for token, lp in zip(out.new_token_ids, out.logprobs))
                cached[request_id] = out.num_cached_tokens
            if not engine.has_unfinished():
                return seen
        raise AssertionError("the request did not finish in 50 steps")

    cold = answer(engine_for(tmp_path, monkeypatch, True, attention_query_tiles=query_tiles), "cold", prompt)
    engine = engine_for(tmp_path, monkeypatch, True, attention_query_tiles=query_tiles)
    answer(engine, "first", prompt[:64] + [7])  # caches the prompt's first 64 tokens: four blocks of 16
    warm = answer(engine, "warm", prompt)
    assert len(cold) == len(warm) == 8 and cached == {"cold": 0, "first": 0, "warm": 64}, cached
    # Query tiles read packed keys; on the AVX2 kernel (plain keys) every row attends alone even with them on.
    tiles = query_tiles and packed_keys_supported(16, 64, 2)
    assert (warm == cold) is not tiles
