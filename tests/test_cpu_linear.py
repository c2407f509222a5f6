"""The native bf16 linear (packed weights, AVX512-BF16 dot products) against F.linear, and its fallbacks; its int8
weights against their dequantized values, and what they cost the default model in accuracy."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import (cpu_has_amx, native_int8_available, native_int8_max_rows, native_linear_amx,
                            native_linear_available)
from engine.config import EngineConfig
from engine.models.layers import (AMX_NATIVE_MAX_ROWS, AMX_TILES_MAX_ROWS, Linear, default_native_max_rows,
                                  onednn_prepack_available, quantize_int8, select_linear_packing)

needs_native = pytest.mark.skipif(not native_linear_available(),
                                  reason="this CPU has neither AVX512-BF16 nor AVX2 with FMA (or no C++ "
                                         "toolchain): the native linear is not built, and oneDNN or F.linear serve "
                                         "instead")


def linear(in_features: int, out_features: int, bias: bool, packing: str | None) -> Linear:
    torch.manual_seed(in_features + out_features)
    layer = Linear(in_features, out_features, bias)
    layer.weight.data = (torch.randn(out_features, in_features) * 0.05).to(torch.bfloat16)
    if bias:
        layer.bias.data = torch.randn(out_features).to(torch.bfloat16)
    if packing:
        layer.prepack(packing)
    return layer


# The native linear's two kernels: AVX512-BF16 dot products, and AMX tiles where it was built on a CPU with them.
KERNELS = ["dot products"] + (["AMX tiles"] if native_linear_amx() else [])


@pytest.fixture(params=KERNELS)
def linear_kernel(request):
    """Runs the test with the native linear on one of its kernels, then restores the rows from which it takes AMX
    tiles (only for tests marked needs_native: the skip comes first)."""
    before = torch.ops.tokenline.linear_amx_min_rows()
    torch.ops.tokenline.linear_amx_min_rows(1 if request.param == "AMX tiles" else 0)
    try:
        yield request.param
    finally:
        torch.ops.tokenline.linear_amx_min_rows(before)


@needs_native
# Rows: whole and partial tiles of 6 (dot products) and 16 (AMX) rows; from 17 the tiles run two row tiles against
# two blocks (32 and 64: pairs whole; 17: the second tile partial; 33, 49, 100 and 391: the last pair one tile);
# 391: past the early fetch. K=72: the tiles take 32 k at a time, so those run on the dot products.
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 16, 17, 32, 33, 49, 64, 100, 391])
@pytest.mark.parametrize("out_features, in_features", [(48, 64), (24, 72), (50, 576), (3072, 576), (577, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_native_linear_matches_f_linear_in_bf16(rows, out_features, in_features, bias, linear_kernel):
    layer = linear(in_features, out_features, bias, "native")
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    expected = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    # fp32 accumulation either way; the only difference is bf16 rounding of the output.
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=1e-2)
    logits = layer(x, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=1e-4)


@needs_native
@pytest.mark.parametrize("rows", [1, 16, 17, 33, 49, 64, 100, 391])  # 17 on: the tiles' fused path
@pytest.mark.parametrize("out_features, in_features", [(64, 64), (3072, 576), (1152, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_silu_mul_gives_silu_and_mul_of_the_linear_to_the_bit(rows, out_features, in_features, bias,
                                                                       linear_kernel):
    """Linear.silu_mul (a Llama MLP's gate_up_proj then SiLU-and-mul, fused on AMX tiles from 17 rows) against the
    two ops apart, and against F.silu(gate) * up in fp32 within bf16's rounding."""
    from engine.kernels import silu_and_mul
    layer = linear(in_features, out_features, bias, "native")
    x = torch.randn(2, rows, in_features).to(torch.bfloat16)  # leading dims: rows counted over both
    got = layer.silu_mul(x)
    assert got.shape == (2, rows, out_features // 2) and got.dtype == torch.bfloat16
    assert torch.equal(got.reshape(2 * rows, -1), silu_and_mul(layer(x).reshape(2 * rows, out_features)))
    gate, up = F.linear(x.float(), layer.weight.float(),
                        None if layer.bias is None else layer.bias.float()).split(out_features // 2, dim=-1)
    torch.testing.assert_close(got.float(), F.silu(gate) * up, atol=5e-2, rtol=2e-2)


@needs_native
@pytest.mark.parametrize("rows", [5, 21])
def test_native_linear_reads_strided_rows_and_keeps_leading_dims(rows, linear_kernel):
    layer = linear(64, 40, True, "native")
    wide = torch.randn(rows, 96).to(torch.bfloat16)
    x = wide[:, 16:80]  # rows 96 elements apart, last dim contiguous
    expected = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    torch.testing.assert_close(layer(x).float(), expected, atol=2e-2, rtol=1e-2)
    batch = torch.randn(2, 3, 64).to(torch.bfloat16)
    assert layer(batch).shape == (2, 3, 40)


@needs_native
@pytest.mark.parametrize("rows", [17, 32, 33, 100])
def test_rows_read_where_they_lie_and_rows_copied_into_tiles_give_the_same_bits(rows, linear_kernel):
    """From 17 rows the AMX tiles load x's rows where they lie when each starts on a cache line (a last partial row
    tile from a padded copy), and from a tile-by-tile copy of x otherwise: the same sums either way."""
    layer = linear(576, 96, True, "native")
    x = torch.randn(rows, 576).to(torch.bfloat16)
    wide = torch.zeros(rows, 576 + 16, dtype=torch.bfloat16)
    wide[:, 16:] = x
    shifted = wide[:, 16:]  # rows 1,184 bytes apart, 32 bytes off a line
    assert x.data_ptr() % 64 == 0 and shifted.data_ptr() % 64 != 0
    assert torch.equal(layer(x, out_dtype=torch.float32), layer(shifted, out_dtype=torch.float32))
    assert torch.equal(layer(x), layer(shifted))
    assert torch.equal(layer.silu_mul(x), layer.silu_mul(shifted))


@needs_native
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(linear_kernel):
    """Batch invariance: a request's tokens get the same bits in a step of 1, 7, 16, 17 or 100 rows (each kernel
    sums a row's products in one order whatever the tile it is in)."""
    layer = linear(576, 200, True, "native")
    x = torch.randn(100, 576).to(torch.bfloat16)
    alone = layer(x[3:4], out_dtype=torch.float32)
    for rows in (7, 16, 17, 100):
        assert torch.equal(layer(x[:rows], out_dtype=torch.float32)[3:4], alone), rows


@needs_native
def test_an_odd_input_width_falls_back_to_onednn():
    layer = linear(63, 40, False, "native")
    # oneDNN's prepacked bf16 where this CPU has it (AVX512 or AVX-NE-CONVERT), else F.linear
    assert layer.packing == ("onednn" if onednn_prepack_available() else None)
    x = torch.randn(3, 63).to(torch.bfloat16)
    torch.testing.assert_close(layer(x).float(), F.linear(x.float(), layer.weight.float()), atol=2e-2, rtol=1e-2)


@needs_native
def test_native_linear_handles_an_empty_batch():
    layer = linear(64, 40, False, "native")
    assert layer(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 40)


def test_packing_is_native_on_bf16_cpu_when_built_and_onednn_for_fp32():
    cpu = torch.device("cpu")
    assert select_linear_packing(cpu, torch.float32) == ("onednn" if onednn_prepack_available(torch.float32) else None)
    assert select_linear_packing(cpu, torch.float32, enabled=False) is None  # prepack_weights: false
    assert select_linear_packing(torch.device("meta"), torch.float32) is None
    assert select_linear_packing(cpu, torch.bfloat16, enabled=False) is None
    expected = "native" if native_linear_available() else select_linear_packing(cpu, torch.bfloat16)
    assert select_linear_packing(cpu, torch.bfloat16) == expected


@pytest.mark.skipif(not onednn_prepack_available(torch.float32), reason="oneDNN's prepacked fp32 linear is missing "
                    "in this torch build: fp32 linears stay on F.linear")
@pytest.mark.parametrize("rows", [1, 3, 8, 32, 257])
@pytest.mark.parametrize("out_features, in_features", [(96, 576), (577, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_prepacked_on_onednn_matches_f_linear(rows, out_features, in_features, bias):
    torch.manual_seed(rows + out_features)
    layer = Linear(in_features, out_features, bias)
    layer.weight.data = torch.randn(out_features, in_features) * 0.05
    if bias:
        layer.bias.data = torch.randn(out_features)
    expected = F.linear(x := torch.randn(rows, in_features), layer.weight, layer.bias)
    layer.prepack(select_linear_packing(torch.device("cpu"), torch.float32))
    assert layer.packing == "onednn"
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)  # fp32 sums in another order, no rounding


def test_every_packing_gives_the_same_layer_output():
    x = torch.randn(3, 576).to(torch.bfloat16)
    reference = linear(576, 96, True, None)(x).float()
    for packing in ["onednn"] + (["native"] if native_linear_available() else []):
        try:
            out = linear(576, 96, True, packing)(x).float()
        except (AttributeError, RuntimeError):  # oneDNN's private ops missing in this torch build
            continue
        torch.testing.assert_close(out, reference, atol=3e-2, rtol=2e-2)


needs_int8 = pytest.mark.skipif(not native_int8_available(),
                                reason="int8 weights run on AVX512-VNNI or AVX2, which this CPU lacks (or no C++ "
                                       "toolchain)")
needs_both = pytest.mark.skipif(not (native_linear_available() and onednn_prepack_available()),
                                reason="needs the native linear and oneDNN's prepacked one")


@needs_both
@pytest.mark.parametrize("int8", [False, True])
def test_steps_past_the_native_rows_run_onednn_and_the_rest_stay_native(int8):
    packing = "native-int8" if int8 else "native"
    split, native, onednn = (linear(576, 96, True, p) for p in (packing, packing, "onednn"))
    split.use_onednn_above(4)
    assert split.native_max_rows == (native_int8_max_rows() if int8 else 4)  # int8 weights keep the steps they serve
    for rows in (1, 4, 5, 8, 9, 64):
        x = torch.randn(2, rows, 576).to(torch.bfloat16)  # leading dims: rows counted over all of them
        for dtype in (None, torch.float32):
            out = split(x, out_dtype=dtype)
            assert out.shape == (2, rows, 96) and out.dtype == (dtype or torch.bfloat16)
            expected = (onednn if 2 * rows > split.native_max_rows else native)(x, out_dtype=dtype)
            assert torch.equal(out, expected), rows
    split.prepack(packing)  # prepacking again starts from the native kernel alone
    assert split.packed_onednn is None and split.native_max_rows is None


def test_onednn_takes_the_larger_steps_where_the_cpu_has_amx_and_none_elsewhere():
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        flags = next((line.split() for line in f if line.startswith("flags")), [])
    assert cpu_has_amx() == ("amx_bf16" in flags)
    amx_tiles = AMX_TILES_MAX_ROWS if native_linear_amx() else AMX_NATIVE_MAX_ROWS
    assert default_native_max_rows() == (amx_tiles if "amx_bf16" in flags else None)


def dequantized(packed: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """int8 weights as the kernel multiplies them: q * scale, in fp32, [N, K]."""
    blocks, pairs = packed.shape[:2]
    q = packed.permute(0, 2, 1, 3).reshape(blocks * 16, pairs * 2)
    return (q.float() * scales[:, None])[:out_features]


def test_int8_weights_are_within_half_a_step_of_the_bf16_ones():
    weight = (torch.randn(50, 64) * 0.05).to(torch.bfloat16)
    weight[3] = 0  # an all-zero row gets a usable scale
    packed, scales = quantize_int8(weight)
    assert packed.dtype == torch.int8 and packed.shape == (4, 32, 16, 2) and scales.shape == (64,)
    error = (dequantized(packed, scales, 50) - weight.float()).abs()
    # half a step, up to fp32 rounding of w / scale and q * scale
    assert bool((error <= scales[:50, None] / 2 * (1 + 1e-5) + 1e-9).all())
    assert int(packed.abs().max()) == 127  # each row's largest weight uses the whole range


@needs_int8
@pytest.mark.parametrize("rows", [1, 2, 6, 8, 9, 13])  # whole and partial tiles of 6 rows
@pytest.mark.parametrize("out_features, in_features", [(48, 64), (50, 576), (577, 1536), (40, 4098)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_kernel_matches_its_dequantized_weights(rows, out_features, in_features, bias):
    layer = linear(in_features, out_features, bias, None)
    packed, scales = quantize_int8(layer.weight.data)
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    expected = F.linear(x.float(), dequantized(packed, scales, out_features),
                        None if layer.bias is None else layer.bias.float())
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(rows, out_features, dtype=dtype)
        torch.ops.tokenline.packed_linear_int8(out, x, packed, scales, layer.bias, out_features)
        # x is quantized per row to 13 bits: errors up to ~1e-4 of the row's largest products, then the output's.
        tolerance = 2e-3 * float(expected.abs().max()) if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=1e-3 if dtype == torch.float32 else 1e-2)


@needs_int8
def test_int8_layer_uses_int8_weights_for_decode_sized_steps_and_bf16_beyond():
    layer = linear(576, 96, True, "native-int8")
    bf16 = linear(576, 96, True, "native")
    assert layer.packing == "native-int8" and layer.packed_int8.dtype == torch.int8
    most = native_int8_max_rows()
    x = torch.randn(most + 1, 576).to(torch.bfloat16)
    int8_rows = dequantized(layer.packed_int8, layer.scales, 96)
    expected = F.linear(x[:most].float(), int8_rows, layer.bias.float())
    decode = layer(x[:most], out_dtype=torch.float32)
    torch.testing.assert_close(decode, expected, atol=2e-3 * float(expected.abs().max()), rtol=1e-3)
    assert not torch.equal(decode, bf16(x[:most], out_dtype=torch.float32))
    assert torch.equal(layer(x, out_dtype=torch.float32), bf16(x, out_dtype=torch.float32))  # one row more: bf16


def test_int8_steps_go_as_far_as_the_instruction_set_makes_them_pay():
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        flags = next((line.split() for line in f if line.startswith("flags")), [])
    if not native_int8_available():
        assert native_int8_max_rows() == 0
    elif {"avx512_bf16", "avx512_vnni"} <= set(flags):
        assert native_int8_max_rows() == 8  # vpdpwssd at half vdpbf16ps's rate
    else:
        assert {"avx2", "fma"} <= set(flags) and native_int8_max_rows() == 32  # vpmaddwd against fp32 FMAs


@needs_int8
@pytest.mark.parametrize("in_features", [576, 4098])  # one chunk of int32 sums; three, the last a single k pair
def test_int8_rows_do_not_depend_on_their_neighbours(in_features):
    layer = linear(in_features, 96, True, "native-int8")
    rows = min(native_int8_max_rows(), 13)  # every tile shape of the kernels, whole and partial
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    together = layer(x, out_dtype=torch.float32)
    for i in range(rows):
        assert torch.equal(layer(x[i:i + 1], out_dtype=torch.float32)[0], together[i])


def test_int8_needs_the_native_kernel_on_bf16_cpu():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="int8"):
        select_linear_packing(cpu, torch.float32, quantization="int8")
    with pytest.raises(ValueError, match="int8"):
        select_linear_packing(cpu, torch.bfloat16, enabled=False, quantization="int8")
    with pytest.raises(ValueError, match="supported: int8"):
        EngineConfig(model="m", quantization="int4")
    from pydantic import ValidationError

    from deployments.config import AppArgs
    assert AppArgs(engine={"quantization": "int8"}).engine_config().quantization == "int8"
    with pytest.raises(ValidationError, match="int8"):
        AppArgs(engine={"quantization": "int4"})
    assert native_int8_available() == native_linear_available()  # AVX512-VNNI or AVX2: both kernels or neither
    if native_int8_available():
        assert select_linear_packing(cpu, torch.bfloat16, quantization="int8") == "native-int8"
    else:  # no native kernels here: an error, not a silent bf16 engine
        with pytest.raises(ValueError, match="AVX2"):
            select_linear_packing(cpu, torch.bfloat16, quantization="int8")


@needs_int8
def test_int8_default_model_agrees_with_bf16_on_its_greedy_answers(smollm2_path):
    from benchmarks.quant_accuracy import PROMPTS, chat_prompts, compare
    prompts = chat_prompts(str(smollm2_path), PROMPTS[:4])
    bf16, int8 = compare(str(smollm2_path), prompts, max_tokens=32)
    assert bf16.greedy_agreement == 1.0 and bf16.tokens == int8.tokens == 4 * 32
    assert int8.step_tokens == native_int8_max_rows()
    # Measured on the 16 prompts of benchmarks.quant_accuracy: 95.9%, mean logprob -0.665 against bf16's -0.659.
    assert int8.greedy_agreement >= 0.85
    assert int8.mean_logprob >= bf16.mean_logprob - 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_packed_layer_lets_its_plain_weight_go_and_answers_the_same(dtype):
    packing = select_linear_packing(torch.device("cpu"), dtype)
    if packing is None:
        pytest.skip(f"no prepacked {dtype} linear on this CPU or torch build: the layer keeps its plain weight")
    layer = linear(576, 96, True, None)
    layer.weight.data, layer.bias.data = layer.weight.data.to(dtype), layer.bias.data.to(dtype)
    layer.prepack(packing)
    x = torch.randn(5, 576).to(dtype)
    before = layer(x)
    assert layer.drop_plain_weight() == 96 * 576 * dtype.itemsize
    assert layer.weight.is_meta and layer.weight.shape == (96, 576) and layer.weight.dtype == dtype
    assert torch.equal(layer(x), before)
    assert layer.drop_plain_weight() == 0
    with pytest.raises(RuntimeError, match="let go after packing"):
        layer.prepack(packing)
    unpacked = linear(64, 8, False, None)
    assert unpacked.drop_plain_weight() == 0 and not unpacked.weight.is_meta  # F.linear reads it


@pytest.mark.parametrize("tied", [False, True])
def test_an_engine_holds_no_plain_weight_a_packed_copy_replaces_but_the_tied_embeddings(tmp_path, tied):
    from engine import LLMEngine, SamplingParams
    from tests.tiny_models import write_tiny_model

    if select_linear_packing(torch.device("cpu"), torch.bfloat16) is None:
        pytest.skip("no prepacked bf16 linear on this CPU or torch build")
    write_tiny_model(tmp_path, "llama", hidden_size=128, intermediate_size=256, tie_word_embeddings=tied)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="bfloat16", num_kv_blocks=32))
    model = engine.runner.model
    linears = [lin for layer in model.layers for lin in layer.linears()]
    assert linears and all(lin.packed is not None and lin.weight.is_meta for lin in linears)
    assert model.lm_head.weight.is_meta is not tied
    assert (model.lm_head.weight is model.embed_tokens.weight) is tied
    assert not model.embed_tokens.weight.is_meta and not model.norm.weight.is_meta
    [tokens] = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(tokens) == 6
